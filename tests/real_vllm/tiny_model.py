"""Make a tiny Llama target and its EAGLE-3 draft for real vLLM on CPU, nothing downloaded.

    <vllm venv>/bin/python -m tests.real_vllm.tiny_model OUT_DIR     # from the repository root

OUT_DIR/target: the SGLang tests' tokenizer (`tests/real_sglang/tiny_model.py`) and a Llama config; OUT_DIR/draft:
an EAGLE-3 draft config. No weights: the servers start with `--load-format dummy` (random weights, which the
draft's synthetic acceptance makes irrelevant). Runs in the vLLM venv (transformers); the tests import the numbers.

Sizes measured here: a step of a small target is mostly the engine's own overhead, the same for one token or
four, so verifying drafts costs next to nothing even at 64 streams and speculation never loses (hidden 256:
speculative 1.1-1.5x ahead at C=64 in 2 of 4 sweeps). At hidden 512 (8 layers of head_dim 64) the 64 streams'
verification costs real compute, where plain pulls ahead on an idle machine (1.3-1.4x), but a step is still
short enough (30-50 ms) that a busy machine's delays, paid per step and plain takes three steps to speculation's
one, wipe it out: a tie at C=64 beside a test run and two CPU burners, and once in CI speculative 1.4x ahead.
At hidden 1024 the steps are long (100-150 ms at C=64, plain) and the same load leaves plain 1.56x ahead at
C=64 and speculative 1.34x ahead at C=1.
"""

import json
import sys
from pathlib import Path

from tests.real_sglang.tiny_model import VOCAB_SIZE, make_tokenizer

CONTEXT_TOKENS = 4096
LAYERS = 8
HIDDEN = 1024
HEADS = 16  # head_dim 64: vLLM's CPU attention kernels take no smaller head
KV_HEADS = 4
INTERMEDIATE = 4096
# Which target layers' hidden states the draft reads. vLLM's default picks (2, L/2, L-3): for L < 7 a layer
# twice, and the first request then kills the engine; listed, so a smaller target stays possible.
AUX_LAYERS = [1, LAYERS // 2, LAYERS - 2]


def llama(fast, **overrides) -> dict:
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=CONTEXT_TOKENS,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        torch_dtype="bfloat16",
    ).to_dict()
    return {**config, **overrides}


def make(out: Path) -> Path:
    target, draft = out / "target", out / "draft"
    fast = make_tokenizer(target, CONTEXT_TOKENS)
    (target / "config.json").write_text(json.dumps(llama(fast, architectures=["LlamaForCausalLM"]), indent=2))
    draft.mkdir(parents=True, exist_ok=True)
    eagle = llama(
        fast,
        architectures=["LlamaForCausalLMEagle3"],
        num_hidden_layers=1,
        draft_vocab_size=VOCAB_SIZE,
        eagle_aux_hidden_state_layer_ids=AUX_LAYERS,
    )
    (draft / "config.json").write_text(json.dumps(eagle, indent=2))
    return out


def build(venv: Path, out: Path, root: Path) -> Path:
    """`make(out)` run in `venv`'s Python (it has transformers) from the repository `root`; AssertionError if not."""
    import subprocess

    from crossover.servers.sglang_check import venv_python

    made = subprocess.run(
        [str(venv_python(venv)), "-m", "tests.real_vllm.tiny_model", str(out)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert made.returncode == 0, made.stderr[-2000:]
    return out


if __name__ == "__main__":
    print(make(Path(sys.argv[1])))
