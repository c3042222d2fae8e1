"""What a checkpoint records about its tokenizer (the tokenizer's own type; checkpoints import it).

* :class:`TokenizerRecord` -- how to load the files kept in ``CKPT/tokenizer/`` and what the
  tokenizer must look like;
* :data:`PROBE_TEXT` -- the text whose ids every record keeps.
"""

from __future__ import annotations

from dataclasses import dataclass

TOKENIZER_SUBDIR = "tokenizer"  # the tokenizer's files, beside the iteration directories
# Encoded by every tokenizer we record; another tokenizer must encode it to the same ids.
PROBE_TEXT = "The quick brown fox jumps over the lazy dog. 1234 Zürich!\nHello, world: ünïcödé?"


@dataclass(frozen=True, kw_only=True)
class TokenizerRecord:
    """The tokenizer of a checkpoint: how to load its files from ``CKPT/tokenizer/`` and what
    it must look like (vocabulary size, special ids, the ids of :data:`PROBE_TEXT`).

    ``tokenizer_type`` is Megatron's name (``GPT2BPETokenizer``, ``BertWordPieceLowerCase``,
    ``BertWordPieceCase``, ``SentencePieceTokenizer``, ``GPTSentencePieceTokenizer``,
    ``HuggingFaceTokenizer``); ``files`` are the file names inside the tokenizer directory.
    """

    tokenizer_type: str
    files: tuple[str, ...] = ()
    vocab_size: int = 0
    eod: int | None = None
    cls: int | None = None
    sep: int | None = None
    pad: int | None = None
    mask: int | None = None
    probe_ids: tuple[int, ...] = ()

    def special_ids(self) -> dict[str, int | None]:
        return {"eod": self.eod, "cls": self.cls, "sep": self.sep, "pad": self.pad, "mask": self.mask}
