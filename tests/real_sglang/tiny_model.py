"""Make a tiny Llama for real SGLang on CPU, with the real libraries and nothing downloaded.

    <serve venv>/bin/python tests/real_sglang/tiny_model.py OUT_DIR

Random weights from a `LlamaConfig` (`save_pretrained`: config.json + safetensors), a byte-level BPE tokenizer
trained here with `tokenizers` on a few sentences, saved as a `PreTrainedTokenizerFast` with a chat template.
`make` runs in the serve venv (torch, transformers, tokenizers); the project's tests import only the numbers.
Seeded: the same folder each time.
"""

import sys
from pathlib import Path

VOCAB_SIZE = 512
# Room for streams that last seconds (the tiny model decodes thousands of tokens a second); a prompt past it
# is SGLang's 400.
CONTEXT_TOKENS = 32768
LOGIT_SPREAD = 25.0
SPECIAL = ["<|pad|>", "<|bos|>", "<|eos|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts tokens and verifies them in one pass.",
    "A gateway routes each request to the pool that serves the load best.",
    "Say OK. Hello, how are you today? Count from one to ten.",
    "0 1 2 3 4 5 6 7 8 9 10 one two three four five six seven eight nine ten",
    "user assistant system: What is the capital of France? Paris is.",
]


def make_tokenizer(out: Path, context_tokens: int = CONTEXT_TOKENS):
    """The byte-level BPE tokenizer, saved in `out`; returned (its special ids go into the model's config)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(CORPUS * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<|pad|>", bos_token="<|bos|>", eos_token="<|eos|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = context_tokens
    fast.save_pretrained(out)
    return fast


def make(out: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    fast = make_tokenizer(out)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=CONTEXT_TOKENS,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        # Random logits are near-ties (std ~0.2); a greedy choice then flips with the batch SGLang happens to
        # run. Spread wide, the same request gets the same tokens each time, so a test can compare bytes.
        model.lm_head.weight.mul_(LOGIT_SPREAD)
    model.save_pretrained(out)
    return out


if __name__ == "__main__":
    print(make(Path(sys.argv[1])))
