"""Test helpers for finetuning: a tiny random Hugging Face BERT directory with a tiny WordPiece
tokenizer trained on the test's own texts (no downloads), and small official-format task files."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tests.finetune_wordpiece import tiny_wordpiece

# Words every tiny finetuning vocabulary needs (the built-in tasks' most common words).
FINETUNE_WORDS = [
    "the",
    "a",
    "movie",
    "was",
    "good",
    "bad",
    "great",
    "awful",
    "who",
    "founded",
    "in",
    "what",
    "year",
    "city",
    "staff",
    "museum",
    "company",
    "is",
    "not",
]


def make_tiny_hf_bert(path: Path, texts: Iterable[str], *, layers: int = 2, hidden: int = 32, heads: int = 4,
                      max_positions: int = 128, megatron: bool = False) -> Path:  # fmt: skip
    """Write a random ``BertModel`` (or ``MegatronBertForPreTraining``) + tokenizer to ``path``."""
    import torch
    from transformers import (
        BertConfig,
        BertModel,
        MegatronBertConfig,
        MegatronBertForPreTraining,
        PreTrainedTokenizerFast,
    )

    tok = tiny_wordpiece(texts, vocab_size=400)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
                                   pad_token="[PAD]", mask_token="[MASK]")  # fmt: skip
    kw: dict[str, Any] = dict(vocab_size=tok.get_vocab_size(), hidden_size=hidden, num_hidden_layers=layers,
              num_attention_heads=heads, intermediate_size=2 * hidden, max_position_embeddings=max_positions,
              type_vocab_size=2, hidden_act="gelu")  # fmt: skip
    torch.manual_seed(0)
    model = MegatronBertForPreTraining(MegatronBertConfig(**kw)) if megatron else BertModel(BertConfig(**kw))
    model.save_pretrained(str(path))
    fast.save_pretrained(str(path))
    return path


def write_squad(path: Path, paragraphs: list[tuple[str, list[tuple[str, str, str | None]]]]) -> Path:
    """Official SQuAD JSON from ``[(context, [(qid, question, answer text or None), ...])]``."""
    data = []
    for context, qas in paragraphs:
        entries = []
        for qid, question, answer in qas:
            answers = [] if answer is None else [{"text": answer, "answer_start": context.index(answer)}]
            entries.append(
                {"id": qid, "question": question, "answers": answers, "is_impossible": answer is None}
            )
        data.append({"title": "t", "paragraphs": [{"context": context, "qas": entries}]})
    path.write_text(json.dumps({"version": "v2.0", "data": data}))
    return path
