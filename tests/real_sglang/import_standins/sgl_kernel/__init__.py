"""Stand-in for `sgl_kernel`, SGLang's CUDA kernel package: `sglang/kernels/ops/kvcache/cache_move.py` imports it
at start-up even on the CPU path, and the registry's `sglang-kernel` wheel has only sm90/sm100 builds (its
loader raises without `libcuda.so.1`). With `SGLANG_USE_CPU_ENGINE=1 --device cpu --attention-backend
torch_native` no op of it runs."""

from _crossover_standin import install

install(__name__)
