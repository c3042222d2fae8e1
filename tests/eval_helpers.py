"""Shared by the ``test_eval_*`` tests: a tiny GPT-2 BPE tokenizer + random GPT-2 saved as an HF directory."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from mlm_eval.builtin import builtin_path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

EOT = "<|endoftext|>"


def sample_corpus() -> list[str]:
    """Training text for the tiny tokenizer: the built-in samples (both formats)."""
    wiki = builtin_path("wikitext_sample.tokens").read_text(encoding="utf-8")
    lambada = builtin_path("lambada_sample.jsonl").read_text(encoding="utf-8")
    return wiki.splitlines() + lambada.splitlines()


def build_tiny_hf(directory: Path, *, n_positions: int = 64, vocab_padding: int = 0, seed: int = 0) -> Path:
    """Train a byte-level BPE (~400 tokens), build a random 2-layer GPT-2, save both to ``directory``."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(sample_corpus(), vocab_size=400, min_frequency=2, special_tokens=[EOT])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer, bos_token=EOT, eos_token=EOT, unk_token=EOT
    )
    tokenizer.save_pretrained(directory)
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=len(tokenizer) + vocab_padding,
        n_positions=n_positions,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=vocab_padding == 0,
    )
    model = GPT2LMHeadModel(config).eval()
    if vocab_padding:
        rig_padded_rows(model, len(tokenizer))
    model.save_pretrained(directory)
    return directory


def rig_padded_rows(model: Any, true_vocab: int) -> None:
    """Make the padded vocabulary rows win every argmax (and hold most of the mass) if not trimmed."""
    with torch.no_grad():
        model.transformer.ln_f.bias[0] = 50.0  # every final hidden state gets a large component 0
        model.lm_head.weight[true_vocab:] = 0.0
        model.lm_head.weight[true_vocab:, 0] = 10.0  # so padded logits are ~500


def load_tiny(directory: Path):  # type: ignore[no-untyped-def]
    """(model, tokenizer) from ``directory``."""
    from transformers import AutoTokenizer, GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(directory).eval(), AutoTokenizer.from_pretrained(directory)


def reference_logprobs(model, ids: list[int], vocab: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Plain HF forward of one unpadded sequence: float64 log-softmax over the first ``vocab`` logits."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :, :vocab]
    return torch.log_softmax(logits.double(), dim=-1)
