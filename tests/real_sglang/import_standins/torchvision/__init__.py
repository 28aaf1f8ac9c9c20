"""Stand-in for `torchvision`: SGLang's model-config registry imports `torchvision.transforms` for its
multimodal models (`sglang/srt/multimodal/internvl_utils.py`), and the registry's torchvision wheel is the CUDA
build (its `_C.so` needs `libc10_cuda.so`); the CPU build is not on the registry. A text-only Llama never
calls it."""

from _crossover_standin import install

install(__name__)
