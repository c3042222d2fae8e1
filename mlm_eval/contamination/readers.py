"""Eval-set and training-corpus readers for ``mlm-eval contamination``.

Eval sets (``--eval``), each a list of named examples:

* ``wikitext103``: the raw WikiText-103 test file (``wiki.test.raw``); the whole file is used and
  split into articles at level-1 headings (lines `` = Title = ``; ``= = Section = =`` lines stay
  inside their article); each article, heading included, is one example named by its title.
* ``lambada``: JSON lines ``{"text": ...}``; one example per line, named ``line N``.
* ``jsonl``: JSON lines with ``--eval-text-key`` (default ``text``); named by ``--eval-id-key``
  when present, else ``line N``.
* ``text``: one example per non-blank line, named ``line N``.

Training corpora (``--train``, any number, format chosen per path):

* ``*.jsonl`` / ``*.json``: JSON lines, one document per line (``--train-text-key``).
* an indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``, as written by ``mlm-preprocess``; give the
  prefix or either file): each document (its sequences together, end-of-document tokens dropped)
  is detokenized with the tokenizer named by Megatron's flags (``--tokenizer-type``,
  ``--vocab-file``, ``--merge-file``, ``--tokenizer-model``); the modules are imported lazily.
* anything else: raw text; the whole file is one document (n-grams span line breaks), streamed in
  pieces of about 1 MB.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pretrain.utils.errors import UserError
from pretrain.utils.jsonl import iter_json_objects, string_field

if TYPE_CHECKING:
    from pretrain.tokenizer.factory import TokenizerConfig

EVAL_TASKS = ("wikitext103", "lambada", "jsonl", "text")
_WIKITEXT_HEADING = re.compile(r"^ ?= (?!=)(.*?) = ?$")
_RAW_PIECE_CHARS = 1 << 20


@dataclass(frozen=True, kw_only=True)
class EvalExample:
    """One eval example: a display name and its text."""

    name: str
    text: str


def _require_file(path: Path, flag: str) -> None:
    if not path.is_file():
        raise UserError(f"{flag}: file not found: {path}")


def read_wikitext_articles(path: Path) -> list[EvalExample]:
    """Split a raw WikiText file into articles at level-1 headings (text before the first kept too)."""
    _require_file(path, "--data")
    examples: list[EvalExample] = []
    name = "(before first heading)"
    lines: list[str] = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            match = _WIKITEXT_HEADING.match(line.rstrip("\n"))
            if match is not None:
                if "".join(lines).strip():
                    examples.append(EvalExample(name=name, text="".join(lines)))
                name, lines = match.group(1).strip(), []
            lines.append(line)
    if "".join(lines).strip():
        examples.append(EvalExample(name=name, text="".join(lines)))
    return examples


def read_jsonl_examples(path: Path, *, text_key: str, id_key: str | None) -> list[EvalExample]:
    """One example per JSON line."""
    examples = []
    for number, record in iter_json_objects(path, flag="--data"):
        text = string_field(record, text_key, source=path, line=number)
        name = record.get(id_key) if id_key else None
        examples.append(EvalExample(name=str(name) if name is not None else f"line {number}", text=text))
    return examples


def read_text_examples(path: Path) -> list[EvalExample]:
    """One example per non-blank line."""
    _require_file(path, "--data")
    with open(path, encoding="utf-8") as fh:
        return [
            EvalExample(name=f"line {i}", text=line) for i, line in enumerate(fh, start=1) if line.strip()
        ]


def read_eval_examples(
    task: str, path: Path, *, text_key: str = "text", id_key: str | None = None
) -> list[EvalExample]:
    """Read the examples of an eval set (see the module docstring)."""
    if task == "wikitext103":
        return read_wikitext_articles(path)
    if task == "lambada":
        return read_jsonl_examples(path, text_key="text", id_key=None)
    if task == "jsonl":
        return read_jsonl_examples(path, text_key=text_key, id_key=id_key)
    if task == "text":
        return read_text_examples(path)
    raise UserError(f"--eval: unknown task {task!r} (choose from {', '.join(EVAL_TASKS)})")


def _indexed_prefix(path: Path) -> Path | None:
    """The ``.bin/.idx`` prefix when ``path`` names an indexed dataset, else None."""
    prefix = path.with_suffix("") if path.suffix in (".bin", ".idx") else path
    bin_file, idx_file = prefix.with_name(prefix.name + ".bin"), prefix.with_name(prefix.name + ".idx")
    return prefix if bin_file.is_file() and idx_file.is_file() else None


def _iter_jsonl(path: Path, text_key: str) -> Iterator[tuple[str, bool]]:
    for number, record in iter_json_objects(path, flag="--train"):
        yield string_field(record, text_key, source=path, line=number, hint="see --train-text-key"), True


def _iter_raw(path: Path) -> Iterator[tuple[str, bool]]:
    with open(path, encoding="utf-8", errors="replace") as fh:
        while True:
            # Whole lines, so a word is never cut in two between pieces.
            piece = "".join(fh.readlines(_RAW_PIECE_CHARS))
            if not piece:
                break
            yield piece, False
    yield "", True


def _iter_indexed(prefix: Path, tokenizer: TokenizerConfig | None) -> Iterator[tuple[str, bool]]:
    if tokenizer is None:
        raise UserError(
            f"--train {prefix}: an indexed dataset needs --tokenizer-type (and its files) to detokenize it"
        )
    # Lazy: only indexed-dataset input needs these modules.
    from pretrain.data.indexed_dataset import IndexedDataset
    from pretrain.tokenizer.factory import build_tokenizer

    tok = build_tokenizer(tokenizer)
    eod = tok.eod
    dataset = IndexedDataset(prefix)
    for doc in range(dataset.num_documents):
        ids = [int(t) for t in dataset.get_document(doc) if int(t) != eod]  # the appended end-of-document
        yield tok.detokenize(ids), True


def iter_train_segments(
    path: Path, *, text_key: str = "text", tokenizer: TokenizerConfig | None = None
) -> Iterator[tuple[str, bool]]:
    """Yield ``(text, end_of_document)`` pieces of a training corpus (see the module docstring)."""
    prefix = _indexed_prefix(path)
    if prefix is not None:
        yield from _iter_indexed(prefix, tokenizer)
        return
    _require_file(path, "--train")
    if path.suffix in (".jsonl", ".json"):
        yield from _iter_jsonl(path, text_key)
    else:
        yield from _iter_raw(path)
