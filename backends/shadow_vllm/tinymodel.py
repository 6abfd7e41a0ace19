"""A tiny random-weight Llama built offline, for tests and CPU benchmarks.

:func:`build_tiny_model` writes, into a folder, a 2-layer ``LlamaForCausalLM``
(hidden 128, 4 heads, 2 KV heads, head_dim 32: a head size vLLM's CPU
attention backend accepts) with seeded random weights, and a byte-level BPE
tokenizer trained with ``tokenizers`` on local text, saved through
``PreTrainedTokenizerFast`` with a one-line chat template. Nothing is
downloaded. The outputs are meaningless; the point is a real model that a real
vLLM engine loads, schedules and runs.

Invariants: the same ``seed`` gives the same files; a folder that already
holds a complete model is reused (``config.json``, weights and tokenizer all
present), so a test session builds it once.
"""

from __future__ import annotations

from pathlib import Path

#: Local text the tokenizer is trained on (no download): a few sentences
#: of ordinary English and code, repeated, so BPE has merges to learn.
_CORPUS = (
    "The quick brown fox jumps over the lazy dog. ",
    "An agent session calls a model, reads a tool result, and calls again. ",
    "def main():\n    return sum(range(10))\n",
    "Shadow prefill keeps the next model warm while the router decides. ",
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ {}[]()<>=+-*/.,;:!?'\"",
)

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def build_tiny_model(path: str | Path, *, vocab_size: int = 1024, num_layers: int = 2, seed: int = 0,
                     max_position_embeddings: int = 8192) -> Path:
    """Write the tiny model and its tokenizer into ``path``; returns the folder."""
    out = Path(path)
    if all((out / f).exists() for f in _FILES):
        return out
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(vocab_size)
    tokenizer.save_pretrained(str(out))
    _save_model(out, len(tokenizer), num_layers, seed, max_position_embeddings, tokenizer)
    return out


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|tool|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([line * 20 for line in _CORPUS], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _save_model(out: Path, vocab_size: int, num_layers: int, seed: int, max_positions: int, tokenizer) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=max_positions,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False, torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(str(out), safe_serialization=True)
