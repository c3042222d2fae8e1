"""Reading and encoding the records of ``mlm-preprocess`` (see :mod:`tools.preprocess` for the
formats): input records in order, the built-in sentence splitter, and the per-record encoding that
runs in worker processes (a malformed record becomes its one-line reason, never an exception)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pretrain.tokenizer.base import Tokenizer
from pretrain.tokenizer.factory import TokenizerConfig, build_tokenizer

JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")
INPUT_FORMATS = ("auto", "jsonl", "text", "text-blocks")

# --------------------------------------------------------------------------------------------- sentences

_ABBREVIATIONS = frozenset([
    "mr", "mrs", "ms", "dr", "prof", "sr", "jr", "st", "vs", "etc", "e.g", "i.e", "cf", "al", "inc",
    "ltd", "co", "corp", "no", "nos", "fig", "figs", "eq", "approx", "dept", "est", "gen", "gov", "lt",
    "col", "sgt", "capt", "mt", "jan", "feb", "mar", "apr", "jun", "jul", "aug", "sep", "sept", "oct",
    "nov", "dec",
])  # fmt: skip
_BOUNDARY = re.compile(r"[.!?]+[\"'\u201d\u2019)\]]*(?=\s+[\"'\u201c\u2018(\[]?[A-Z0-9\u00c0-\u00de])")
_PARAGRAPH = re.compile(r"\n[ \t\r\f\v]*\n")


def split_sentences(text: str) -> list[str]:
    """Split ``text`` into sentences (see the module docstring for the rule); strips whitespace."""
    sentences: list[str] = []
    for para in _PARAGRAPH.split(text):
        start = 0
        for m in _BOUNDARY.finditer(para):
            before = para[start : m.start()]
            word = before.rsplit(None, 1)[-1] if before.strip() else ""
            bare = word.lstrip("\"'([\u201c\u2018").lower()
            if m.group(0)[0] == "." and (bare in _ABBREVIATIONS or (len(bare) == 1 and bare.isalpha())):
                continue
            piece = para[start : m.end()].strip()
            if piece:
                sentences.append(piece)
            start = m.end()
        tail = para[start:].strip()
        if tail:
            sentences.append(tail)
    return sentences


# --------------------------------------------------------------------------------------------- encoding


@dataclass(frozen=True)
class EncodeSpec:
    tokenizer: TokenizerConfig
    keys: tuple[str, ...]
    split_sentences: bool
    append_eod: bool


class _Bad(Exception):
    pass


def encode_record(
    raw: bytes, fmt: str, spec: EncodeSpec, tok: Tokenizer
) -> list[tuple[np.ndarray, list[int]]]:
    """One input record -> per key (tokens, sequence lengths); raises :class:`_Bad` with a reason."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _Bad(f"invalid UTF-8 (byte 0x{raw[exc.start]:02x} at byte offset {exc.start})") from None
    if fmt == "jsonl":
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise _Bad(f"invalid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(obj, dict):
            raise _Bad(f"expected a JSON object, got {type(obj).__name__}")
        values = []
        for key in spec.keys:
            if key not in obj:
                raise _Bad(f"missing key {key!r}")
            if not isinstance(obj[key], str):
                raise _Bad(f"key {key!r} is not a string (got {type(obj[key]).__name__})")
            values.append(obj[key])
    else:
        values = [text]
    out = []
    for value in values:
        pieces = split_sentences(value) if spec.split_sentences else [value]
        seqs = [ids for ids in (tok.tokenize(p) for p in pieces) if ids]
        if seqs and spec.append_eod:
            seqs[-1].append(tok.eod)  # type: ignore[arg-type]
        lengths = [len(s) for s in seqs]
        flat = np.fromiter((t for s in seqs for t in s), dtype=np.int64, count=sum(lengths))
        out.append((flat, lengths))
    return out


_WORKER_STATE: tuple[EncodeSpec, Tokenizer] | None = None


def init_worker(spec: EncodeSpec) -> None:
    global _WORKER_STATE
    _WORKER_STATE = (spec, build_tokenizer(spec.tokenizer))


Record = tuple[int, int, str, bytes]  # (file number, line number, format, raw bytes)


def encode_job(item: Record) -> tuple[int, int, int, Any]:
    file_no, lineno, fmt, raw = item
    assert _WORKER_STATE is not None
    spec, tok = _WORKER_STATE
    try:
        return file_no, lineno, len(raw), encode_record(raw, fmt, spec, tok)
    except _Bad as bad:
        return file_no, lineno, len(raw), str(bad)


# --------------------------------------------------------------------------------------------- reading


def format_of(path: Path, requested: str) -> str:
    if requested != "auto":
        return requested
    return "jsonl" if path.name.lower().endswith(JSON_SUFFIXES) else "text"


def read_records(paths: list[Path], formats: list[str]) -> Iterator[Record]:
    for file_no, (path, fmt) in enumerate(zip(paths, formats, strict=True)):
        with open(path, "rb") as fh:
            if fmt == "text-blocks":
                block: list[bytes] = []
                first = 0
                for lineno, line in enumerate(fh, 1):
                    if line.strip():
                        if not block:
                            first = lineno
                        block.append(line)
                    elif block:
                        yield file_no, first, fmt, b"".join(block).rstrip(b"\r\n")
                        block = []
                if block:
                    yield file_no, first, fmt, b"".join(block).rstrip(b"\r\n")
                continue
            for lineno, line in enumerate(fh, 1):
                if lineno == 1 and line.startswith(b"\xef\xbb\xbf"):
                    line = line[3:]  # UTF-8 byte-order mark
                if not line.strip():
                    continue
                yield file_no, lineno, fmt, (line if fmt == "jsonl" else line.rstrip(b"\r\n"))
