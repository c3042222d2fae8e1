"""GLUE data: official TSV files and Hugging Face ``glue`` datasets, evaluation, submission files.

Official layout: ``glue_data/<MNLI|QQP|CoLA|SST-2|MRPC|STS-B|QNLI|RTE|WNLI>/{train,dev,test}.tsv``
(MNLI: ``dev_matched``, ``dev_mismatched``, ``test_matched``, ``test_mismatched``). Files are read
as plain tab-separated lines, never with CSV quoting: MNLI and QQP sentences contain bare quotes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from numpy.typing import ArrayLike

from finetune.glue_tasks import GlueSplit, GlueTask, TsvLayout, glue_task
from finetune.metrics import glue_task_metrics
from finetune.tokenization import PairEncoder, PairEncoding, clean_text
from pretrain.utils.atomic import atomic_open
from pretrain.utils.errors import UserError
from pretrain.utils.text import read_utf8

OnBadRow = Literal["error", "skip"]


@dataclass(frozen=True, kw_only=True)
class GlueExample:
    """One example; ``label`` is the class id (float score for STS-B), ``None`` in test files."""

    uid: str
    text_a: str
    text_b: str | None
    label: int | float | None
    source: str  # "file:line" (or "hf:split:row"), for error messages


@dataclass(frozen=True, kw_only=True)
class _Row:
    path: str
    line: int
    fields: list[str]

    def where(self, col: int | None = None) -> str:
        loc = f"{self.path}:{self.line}"
        return loc if col is None else f"{loc} column {col + 1 if col >= 0 else len(self.fields)}"


def resolve_task_dir(task: GlueTask | str, data_dir: str | os.PathLike[str]) -> Path:
    """``data_dir`` itself if it holds the task's files, else ``data_dir/<GLUE dir name>``."""
    task = glue_task(task) if isinstance(task, str) else task
    root = Path(data_dir)
    for cand in (root, root / task.glue_dir):
        if any((cand / s.file).is_file() for s in task.splits):
            return cand
    raise UserError(
        f"--data-dir {root}: no {task.name} files ({', '.join(s.file for s in task.splits)}) "
        f"in it or in {root / task.glue_dir}"
    )


def _parse_label(task: GlueTask, row: _Row, col: int) -> int | float:
    value = row.fields[col].strip()
    if task.is_regression:
        try:
            score = float(value)
        except ValueError:
            raise UserError(f"{row.where(col)}: {task.name} score {value!r} is not a number") from None
        if not 0.0 <= score <= 5.0:
            raise UserError(f"{row.where(col)}: {task.name} score {score} is outside [0, 5]")
        return score
    if value not in task.labels:
        raise UserError(f"{row.where(col)}: {task.name} label {value!r} is not one of {list(task.labels)}")
    return task.labels.index(value)


def _check_header(layout: TsvLayout, row: _Row) -> None:
    assert layout.header is not None
    if layout.num_cols > 0 and len(row.fields) != layout.num_cols:
        raise UserError(f"{row.where()}: header has {len(row.fields)} columns, expected {layout.num_cols}")
    for col, name in layout.header:
        got = row.fields[col].strip() if -len(row.fields) <= col < len(row.fields) else None
        if got != name:
            raise UserError(
                f"{row.where(col)}: header is {got!r}, expected {name!r} (is this the right file?)"
            )


def _parse_row(task: GlueTask, layout: TsvLayout, row: _Row, data_index: int, n_cols: int) -> GlueExample:
    if len(row.fields) != n_cols:
        raise UserError(f"{row.where()}: {len(row.fields)} tab-separated columns, expected {n_cols}")
    text_a = clean_text(row.fields[layout.a_col]).strip()
    if not text_a:
        raise UserError(f"{row.where(layout.a_col)}: empty text")
    text_b = None
    if layout.b_col is not None:
        text_b = clean_text(row.fields[layout.b_col]).strip()
        if not text_b:
            raise UserError(f"{row.where(layout.b_col)}: empty text")
    label = None if layout.label_col is None else _parse_label(task, row, layout.label_col)
    uid = str(data_index) if layout.id_col is None else row.fields[layout.id_col].strip()
    return GlueExample(uid=uid, text_a=text_a, text_b=text_b, label=label, source=row.where())


def read_glue_tsv(
    task: GlueTask | str,
    split: GlueSplit | str,
    path: str | os.PathLike[str],
    *,
    on_bad_row: OnBadRow = "error",
) -> list[GlueExample]:
    """Read one official GLUE TSV file of ``task``'s ``split``.

    A malformed row raises :class:`UserError` naming file, line and column; with
    ``on_bad_row="skip"`` such rows are dropped instead (the original Quora dump has a few).
    """
    task = glue_task(task) if isinstance(task, str) else task
    split = task.split(split) if isinstance(split, str) else split
    layout = split.layout
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{task.name} {split.name} file {path} does not exist")
    lines = [line.rstrip("\r") for line in read_utf8(path).split("\n")]
    rows = [_Row(path=str(path), line=i + 1, fields=line.split("\t")) for i, line in enumerate(lines) if line]
    if layout.header is not None:
        if not rows:
            raise UserError(f"{path}: empty file, expected a header row")
        _check_header(layout, rows[0])
        n_cols, rows = len(rows[0].fields), rows[1:]
    else:
        n_cols = layout.num_cols
    examples = []
    for i, row in enumerate(rows):
        try:
            examples.append(_parse_row(task, layout, row, i, n_cols))
        except UserError:
            if on_bad_row == "error":
                raise
    return examples


def read_glue_split(
    task: GlueTask | str, data_dir: str | os.PathLike[str], split: str, *, on_bad_row: OnBadRow = "error"
) -> list[GlueExample]:
    """Read ``split`` (``train``, ``dev``, ``dev_matched``, ``test``, ...) from a GLUE directory."""
    task = glue_task(task) if isinstance(task, str) else task
    s = task.split(split)
    return read_glue_tsv(task, s, resolve_task_dir(task, data_dir) / s.file, on_bad_row=on_bad_row)


def read_glue_hf(task: GlueTask | str, dataset: Any, split: str) -> list[GlueExample]:
    """Examples from one split of a Hugging Face ``datasets`` GLUE dataset (``load_dataset("glue", task)``).

    ``dataset`` is a ``DatasetDict`` (indexed with the task split's HF name, e.g. ``validation_matched``)
    or a single ``Dataset``. Labels are mapped to our convention (HF MNLI: entailment 0, neutral 1,
    contradiction 2); HF test labels (-1) become ``None``.
    """
    task = glue_task(task) if isinstance(task, str) else task
    s = task.split(split)
    if hasattr(dataset, "keys") and callable(dataset.keys):
        if s.hf_split not in dataset:
            raise UserError(
                f"HF dataset for {task.name} has no split {s.hf_split!r}: {sorted(dataset.keys())}"
            )
        dataset = dataset[s.hf_split]
    col_a, col_b = task.hf_columns
    for col in (col_a, col_b, "label"):
        if col is not None and col not in dataset.column_names:
            raise UserError(
                f"HF {task.name} {s.hf_split}: no column {col!r} (columns {dataset.column_names})"
            )
    _check_hf_label_names(task, dataset)
    out = []
    for i, rec in enumerate(dataset):
        where = f"hf:{task.name}:{s.hf_split}:{i}"
        out.append(
            GlueExample(
                uid=str(rec.get("idx", i)),
                text_a=rec[col_a],
                text_b=None if col_b is None else rec[col_b],
                label=_hf_label(task, rec["label"], where),
                source=where,
            )
        )
    return out


def _check_hf_label_names(task: GlueTask, dataset: Any) -> None:
    names = getattr(getattr(dataset, "features", {}).get("label"), "names", None)
    if task.hf_label_names is not None and names is not None and tuple(names) != task.hf_label_names:
        raise UserError(
            f"HF {task.name} label names {names} differ from the expected {list(task.hf_label_names)}; "
            "cannot map them to our label ids"
        )


def _hf_label(task: GlueTask, value: Any, where: str) -> int | float | None:
    if task.is_regression:
        return None if value is None or float(value) < 0 else float(value)
    value = int(value)
    if value < 0:
        return None
    if value >= task.num_labels:
        raise UserError(f"{where}: label {value} out of range for {task.name}")
    return value if task.hf_label_map is None else task.hf_label_map[value]


def encode_glue_examples(examples: Sequence[GlueExample], encoder: PairEncoder) -> list[PairEncoding]:
    """``[CLS] A [SEP] (B [SEP])`` inputs of ``examples`` (pair truncation)."""
    return [encoder.encode(e.text_a, e.text_b) for e in examples]


def evaluate_glue(
    task: GlueTask | str, split_results: Mapping[str, tuple[ArrayLike, ArrayLike]], *, scale: float = 100.0
) -> dict[str, float]:
    """Official metrics from ``{dev split: (predictions, labels)}`` (MNLI: accuracy_m, accuracy_mm)."""
    task = glue_task(task) if isinstance(task, str) else task
    out: dict[str, float] = {}
    for split, (preds, labels) in split_results.items():
        suffix = task.split(split).metric_suffix
        for name, value in glue_task_metrics(task.name, preds, labels, scale=scale).items():
            out[name + suffix] = value
    return out


def write_glue_submission(
    task: GlueTask | str, ids: Sequence[str | int], predictions: ArrayLike, path: str | os.PathLike[str]
) -> Path:
    """Write a GLUE-server prediction file ``index<TAB>prediction`` (label strings; STS-B scores).

    ``predictions`` are class ids (or regression scores for STS-B, clipped to [0, 5]). The file
    name the server expects for each test split is ``GlueSplit.submission_file``.
    """
    task = glue_task(task) if isinstance(task, str) else task
    preds = np.asarray(predictions)
    if len(ids) != len(preds):
        raise UserError(f"{task.name} submission: {len(ids)} ids but {len(preds)} predictions")
    lines = ["index\tprediction"]
    for uid, p in zip(ids, preds.tolist(), strict=True):
        if task.is_regression:
            value = f"{min(max(float(p), 0.0), 5.0):.3f}"
        else:
            if not (float(p).is_integer() and 0 <= int(p) < task.num_labels):
                raise UserError(f"{task.name} submission: prediction {p!r} for {uid} is not a class id")
            value = task.labels[int(p)]
        lines.append(f"{uid}\t{value}")
    path = Path(path)
    with atomic_open(path, "w", encoding="utf-8") as fh:
        fh.write("\n".join(lines) + "\n")
    return path
