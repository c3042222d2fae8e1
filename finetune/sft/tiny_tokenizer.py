"""A tiny offline chat tokenizer for the built-in SFT data (demos and tests).

A byte-level BPE (about 400 tokens) trained on the built-in chat data and pretraining corpus, with
ChatML's special tokens (``<|endoftext|>`` = pad, ``<|im_start|>``, ``<|im_end|>`` = eos, no BOS)
and the built-in chat template, whose ``{% generation %}`` markers tell transformers which tokens
the assistant produced. Nothing is downloaded.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

BUILTIN = Path(__file__).resolve().parent.parent / "builtin"
CHAT_TEMPLATE_FILE = BUILTIN / "chat_template.jinja"
SFT_CHAT_FILE = BUILTIN / "sft_chat.jsonl"
SFT_COMPLETION_FILE = BUILTIN / "sft_completion.jsonl"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def _texts() -> Iterator[str]:
    from pretrain.data.builtin import builtin_corpus_path

    for path in (SFT_CHAT_FILE, SFT_COMPLETION_FILE):
        for line in path.read_text(encoding="utf-8").splitlines():
            rec = json.loads(line)
            for m in rec.get("messages", []):
                yield f"{m['role']}\n{m['content']}"
            if "prompt" in rec:
                yield rec["prompt"] + rec["completion"]
    with open(builtin_corpus_path(), encoding="utf-8") as fh:
        for line in fh:
            yield json.loads(line)["text"]


def write_tiny_chat_tokenizer(directory: str | Path, *, vocab_size: int = 400) -> Path:
    """Train the tokenizer and ``save_pretrained`` it (with the chat template) into ``directory``."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        _texts(), vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS)
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"], clean_up_tokenization_spaces=False,
    )  # fmt: skip
    tok.chat_template = CHAT_TEMPLATE_FILE.read_text(encoding="utf-8")
    out = Path(directory)
    tok.save_pretrained(str(out))
    return out
