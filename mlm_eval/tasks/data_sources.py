"""Evaluation data: raw files, or Hugging Face datasets (hub cache, ``save_to_disk``, parquet/JSON).

``--data PATH`` is a raw file (``wiki.test.tokens``/``.raw``, ``lambada_test.jsonl``, or
``builtin:NAME``), a ``save_to_disk`` directory, or a ``.parquet``/``.json`` file (``.jsonl`` too
for WikiText) read with ``datasets``. ``--dataset NAME [--dataset-config CFG]`` loads a dataset
with ``datasets.load_dataset`` (offline: set ``HF_DATASETS_OFFLINE=1`` and have it cached).
``--split`` (default ``test``) picks the split of a dataset dict.

WikiText rows are the file's lines as the Hugging Face ``wikitext`` dataset stores them (each
ending in ``\\n``, a blank line as ``""``); they are joined back into the raw file text (a blank
line becomes `` \\n``, the raw format's blank line), so T_o and the detokenizer see what they
would on the file. LAMBADA rows carry the example in the text column.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlm_eval.builtin import resolve_data_path
from mlm_eval.tasks.lambada import read_lambada_jsonl
from mlm_eval.tasks.wikitext import read_wikitext
from pretrain.utils.errors import UserError

_DATASET_SUFFIXES = {".parquet": "parquet", ".json": "json", ".jsonl": "json"}


@dataclass(frozen=True, kw_only=True)
class DataSource:
    """Where the evaluation data came from, for the result record."""

    label: str  # the file/directory path, or "NAME[/CFG]:SPLIT" for a hub dataset
    sha256: str  # of the file bytes (raw files) or of the rows' content (datasets)
    sample_data: bool = False  # the built-in sample (builtin:NAME), not a real test set


def add_data_arguments(parser: argparse.ArgumentParser, *, data_help: str) -> None:
    """``--data`` or ``--dataset`` (+ ``--dataset-config``, ``--split``, ``--text-column``)."""
    group = parser.add_argument_group("data")
    group.add_argument("--data", metavar="PATH", help=data_help)
    group.add_argument("--dataset", metavar="NAME", help="a Hugging Face dataset (datasets.load_dataset)")
    group.add_argument("--dataset-config", metavar="CFG", help="the dataset's configuration name")
    group.add_argument("--split", default="test", help="dataset split (default: test)")
    group.add_argument("--text-column", default="text", help="dataset column with the text (default: text)")


def load_wikitext_data(args: argparse.Namespace) -> tuple[str | list[str], DataSource]:
    """The raw WikiText text the flags select, and its source.

    Document-level rows (a ``page`` column, the format of lm-evaluation-harness's
    ``wikitext_document_level`` data, used when the ``--text-column`` is absent) come back as the
    list of pages, to be scored page by page as given (never re-split).
    """
    path = _data_path(args)
    if path is not None and not _is_dataset_path(path):
        return read_wikitext(path), DataSource(label=str(path), sha256=_file_sha256(path),
                                               sample_data=is_builtin(args.data))  # fmt: skip
    rows, label = _dataset_rows(args, path, page_column=True)
    if getattr(args, "_page_rows", False):
        if not any(page.strip() for page in rows):
            raise UserError(f"{label}: WikiText pages are empty")
        digest = hashlib.sha256("\n".join(json.dumps(p) for p in rows).encode("utf-8")).hexdigest()
        return rows, DataSource(label=label, sha256=digest, sample_data=is_builtin(args.data))
    text = "".join(_wikitext_line(row) for row in rows)
    if not text.strip():
        raise UserError(f"{label}: WikiText data is empty")
    return text, DataSource(label=label, sha256=hashlib.sha256(text.encode("utf-8")).hexdigest())


def load_lambada_data(args: argparse.Namespace) -> tuple[list[str], DataSource]:
    """The LAMBADA texts the flags select, and their source."""
    path = _data_path(args)
    if path is not None and (not _is_dataset_path(path) or path.suffix == ".jsonl"):
        return read_lambada_jsonl(path), DataSource(label=str(path), sha256=_file_sha256(path),
                                                    sample_data=is_builtin(args.data))  # fmt: skip
    texts, label = _dataset_rows(args, path)
    if not texts:
        raise UserError(f"{label}: no LAMBADA examples")
    for i, text in enumerate(texts):
        if len(text.split()) < 2:
            raise UserError(f"{label}: row {i}: text needs a context and a last word, got {text!r}")
    digest = hashlib.sha256("\n".join(json.dumps(t) for t in texts).encode("utf-8")).hexdigest()
    return texts, DataSource(label=label, sha256=digest)


def is_builtin(data: str | None) -> bool:
    """True for ``builtin:NAME`` and for paths inside the packaged sample folder."""
    if data is None:
        return False
    if data.startswith("builtin:"):
        return True
    import mlm_eval.builtin

    try:
        return Path(data).resolve().is_relative_to(Path(mlm_eval.builtin.__file__).resolve().parent)
    except (OSError, ValueError):
        return False


def _data_path(args: argparse.Namespace) -> Path | None:
    if (args.data is None) == (args.dataset is None):
        raise UserError("give exactly one of --data PATH or --dataset NAME")
    return None if args.data is None else resolve_data_path(args.data)


def _is_dataset_path(path: Path) -> bool:
    return path.is_dir() or path.suffix in _DATASET_SUFFIXES


def _wikitext_line(row: str) -> str:
    if not row:
        return " \n"
    return row if row.endswith("\n") else row + "\n"


def _dataset_rows(
    args: argparse.Namespace, path: Path | None, *, page_column: bool = False
) -> tuple[list[str], str]:
    """The text column of the selected split, and a label naming the source (``page_column``:
    a ``page`` column stands in for an absent default ``text`` column; sets ``args._page_rows``)."""
    import datasets  # lazy: slow import

    if path is None:
        label = f"{args.dataset}{'/' + args.dataset_config if args.dataset_config else ''}:{args.split}"
        loaded = _guard(
            label, lambda: datasets.load_dataset(args.dataset, args.dataset_config, split=args.split)
        )
    elif path.is_dir():
        label = str(path)
        loaded = _guard(label, lambda: datasets.load_from_disk(str(path)))
    else:
        label = str(path)
        kind = _DATASET_SUFFIXES[path.suffix]
        loaded = _guard(label, lambda: datasets.load_dataset(kind, data_files=str(path), split="train"))
    if isinstance(loaded, datasets.DatasetDict):
        if args.split not in loaded:
            raise UserError(f"{label}: no split {args.split!r} (has {', '.join(loaded)}); use --split")
        loaded = loaded[args.split]
    column = args.text_column
    if (
        page_column
        and column == "text"
        and column not in loaded.column_names
        and "page" in loaded.column_names
    ):
        column = "page"
    if page_column and column == "page":  # document-level rows, as the harness's task reads them
        args._page_rows = True
    if column not in loaded.column_names:
        raise UserError(
            f"{label}: no column {args.text_column!r} (has {', '.join(loaded.column_names)}); use --text-column"
        )
    rows = loaded[column]
    bad = next((i for i, r in enumerate(rows) if not isinstance(r, str)), None)
    if bad is not None:
        raise UserError(f"{label}: row {bad}: column {column!r} is not a string")
    return list(rows), label


def _guard(label: str, load: Any) -> Any:
    """Run a ``datasets`` loader, turning its failures into one-line user errors."""
    try:
        return load()
    except (OSError, ValueError, FileNotFoundError, ImportError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"{label}: cannot load the dataset ({first})") from None
    except Exception as exc:  # datasets raises its own types (DatasetNotFoundError, ...)
        if type(exc).__module__.startswith("datasets"):
            raise UserError(f"{label}: cannot load the dataset ({type(exc).__name__}: {exc})") from None
        raise


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
