"""Tiny SFT fixtures: a random Llama whose tokenizer has a chat template with generation markers,
and the transformers reference of ``valid_loss`` (its assistant mask, mean NLL)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


def make_chat_llama(directory: Path, *, case: str = "llama3", seed: int = 0) -> Path:
    """The tiny chat tokenizer and a random ``case`` model sized to it, saved in ``directory``."""
    from transformers import AutoTokenizer

    from finetune.sft.tiny_tokenizer import write_tiny_chat_tokenizer
    from tests.llama_fixtures import save_llama_with_tokenizer

    tok_dir = write_tiny_chat_tokenizer(directory / "_tok")
    tok = AutoTokenizer.from_pretrained(tok_dir)
    torch.manual_seed(seed)
    save_llama_with_tokenizer(directory, tok, case=case, max_position_embeddings=128)
    return directory


def chat_messages(path: Path) -> list[list[dict[str, str]]]:
    return [json.loads(line)["messages"] for line in path.read_text().splitlines() if line.strip()]


def hf_reference_loss(model_dir: Path, conversations: list[list[dict[str, str]]], *, template: str | None = None,
                      max_ids: int | None = None) -> tuple[float, int]:  # fmt: skip
    """Mean NLL (float64) over transformers' assistant tokens of every conversation, and their count."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    total, count = 0.0, 0
    for msgs in conversations:
        out = tok.apply_chat_template(msgs, chat_template=template, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)  # fmt: skip
        ids = torch.tensor(out["input_ids"][:max_ids])
        mask = torch.tensor(out["assistant_masks"][:max_ids], dtype=torch.bool)
        with torch.no_grad():
            logits = model(ids[None]).logits[0].double()
        nll = -torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[1:, None])[:, 0]
        total += float(nll[mask[1:]].sum())
        count += int(mask[1:].sum())
    return total / count, count
