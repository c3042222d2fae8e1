"""The three finetuning task families: their tensors, loss and official scoring.

* :class:`GlueData`: the nine GLUE tasks (classification; STS-B regression) from the official TSV
  files; dev splits are scored, test splits get GLUE-server submission files.
* :class:`SquadData`: SQuAD 1.1 / 2.0 windows; predictions, n-best and (2.0) null-odds JSON.
* :class:`RaceData`: RACE, four encodings per question; accuracy per subset on dev and test.

Each reuses the readers, encoders, post-processing and metrics of the existing modules.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from numpy.typing import ArrayLike

from finetune.glue import (
    encode_glue_examples,
    evaluate_glue,
    read_glue_split,
    resolve_task_dir,
    write_glue_submission,
)
from finetune.glue_tasks import GlueTask, glue_task
from finetune.heads import HeadConfig
from finetune.race import NUM_CHOICES, RaceExample, build_race_features, race_accuracy, read_race
from finetune.squad import (
    SquadExample,
    SquadFeature,
    SquadFeatureConfig,
    build_squad_features,
    read_squad_json,
)
from finetune.squad_metrics import squad_evaluate
from finetune.squad_postprocess import (
    SquadPostprocessConfig,
    postprocess_squad,
    write_nbest,
    write_null_odds,
    write_squad_predictions,
)
from finetune.tasks import TaskData
from finetune.tokenization import PairEncoder, PairEncoding
from pretrain.training.task import Microbatch
from pretrain.utils.atomic import atomic_open
from pretrain.utils.errors import UserError

Tensors = dict[str, torch.Tensor]
SQUAD_FILES = {
    "squad": {"train": ("train-v1.1.json", "train.json"), "dev": ("dev-v1.1.json", "dev.json")},
    "squad2": {"train": ("train-v2.0.json", "train.json"), "dev": ("dev-v2.0.json", "dev.json")},
}


def encoding_tensors(encs: Sequence[PairEncoding]) -> Tensors:
    """``tokens``, ``tokentype_ids``, ``attention_mask`` ``[n, s]`` (long) of padded encodings."""
    return {
        "tokens": torch.tensor([e.input_ids for e in encs], dtype=torch.long),
        "tokentype_ids": torch.tensor([e.token_type_ids for e in encs], dtype=torch.long),
        "attention_mask": torch.tensor([e.attention_mask for e in encs], dtype=torch.long),
    }


def _write_json(path: Path, obj: Any) -> str:
    with atomic_open(path, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=2)
        fh.write("\n")
    return str(path)


# --- GLUE ---------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class GlueData:
    """A GLUE task: ``labels [n]`` long (float for STS-B); test splits carry label 0 (unused)."""

    name: str
    task: GlueTask
    train: Tensors
    eval_splits: dict[str, Tensors]
    ids: dict[str, list[str]]
    labels: dict[str, np.ndarray | None]  # None for unlabelled test splits
    head: HeadConfig = field(init=False)
    loss_name: str = field(init=False)

    def __post_init__(self) -> None:
        self.head = HeadConfig(kind="classification", num_labels=self.task.num_labels)
        self.loss_name = "mse loss" if self.task.is_regression else "ce loss"

    @classmethod
    def load(cls, name: str, data_dir: str, encoder: PairEncoder) -> GlueData:
        task = glue_task(name)
        task_dir = resolve_task_dir(task, data_dir)

        def tensors_of(split: str) -> tuple[Tensors, list[str], np.ndarray | None]:
            examples = read_glue_split(task, task_dir, split)
            if not examples:
                raise UserError(f"{task_dir / task.split(split).file}: no examples")
            t = encoding_tensors(encode_glue_examples(examples, encoder))
            labelled = all(e.label is not None for e in examples)
            y = np.array([e.label if e.label is not None else 0 for e in examples])
            t["labels"] = torch.tensor(y, dtype=torch.float32 if task.is_regression else torch.long)
            return t, [e.uid for e in examples], y if labelled else None

        train, _, _ = tensors_of("train")
        splits = [
            s for s in (*task.dev_splits, *task.test_splits) if (task_dir / task.split(s).file).is_file()
        ]
        if not any(s in task.dev_splits for s in splits):
            raise UserError(f"--data-dir {task_dir}: no {task.name} dev file ({', '.join(task.dev_splits)})")
        loaded = {s: tensors_of(s) for s in splits}
        return cls(name=name, task=task, train=train, eval_splits={s: v[0] for s, v in loaded.items()},
                   ids={s: v[1] for s, v in loaded.items()}, labels={s: v[2] for s, v in loaded.items()})  # fmt: skip

    def loss_sum(self, output: torch.Tensor, mb: Microbatch) -> torch.Tensor:
        if self.task.is_regression:
            return F.mse_loss(output.float().view(-1), mb["labels"].float(), reduction="sum")
        return F.cross_entropy(output.float(), mb["labels"], reduction="sum")

    def predictions(self, output: np.ndarray) -> np.ndarray:
        return output.reshape(-1) if self.task.is_regression else output.argmax(-1)

    def score(self, outputs: Mapping[str, np.ndarray], out_dir: str | None) -> dict[str, Any]:
        preds = {s: self.predictions(o) for s, o in outputs.items()}
        dev: dict[str, tuple[ArrayLike, ArrayLike]] = {}
        for s, p in preds.items():
            labels = self.labels[s]
            if labels is not None and s in self.task.dev_splits:
                dev[s] = (p, labels)
        metrics = evaluate_glue(self.task, dev)
        files = []
        if out_dir is not None:
            for s, p in preds.items():
                split = self.task.split(s)
                fname = split.submission_file or f"{self.task.glue_dir}-{s}-predictions.tsv"
                files.append(str(write_glue_submission(self.task, self.ids[s], p, Path(out_dir) / fname)))
        return {"metrics": metrics, "details": {}, "files": files}


# --- SQuAD ----------------------------------------------------------------------------------------


def _squad_file(name: str, data_dir: str, split: str) -> Path:
    for fname in SQUAD_FILES[name][split]:
        if (Path(data_dir) / fname).is_file():
            return Path(data_dir) / fname
    raise UserError(f"--data-dir {data_dir}: no SQuAD {split} file ({' or '.join(SQUAD_FILES[name][split])})")


def squad_tensors(features: Sequence[SquadFeature]) -> Tensors:
    t = {
        "tokens": torch.tensor([f.input_ids for f in features], dtype=torch.long),
        "tokentype_ids": torch.tensor([f.token_type_ids for f in features], dtype=torch.long),
        "attention_mask": torch.tensor([f.attention_mask for f in features], dtype=torch.long),
    }
    t["start_positions"] = torch.tensor([f.start_position for f in features], dtype=torch.long)
    t["end_positions"] = torch.tensor([f.end_position for f in features], dtype=torch.long)
    return t


@dataclass(kw_only=True)
class SquadData:
    """SQuAD 1.1 (``squad``) or 2.0 (``squad2``): span logits ``[n, s, 2]`` per window."""

    name: str
    train: Tensors
    eval_splits: dict[str, Tensors]
    dev_examples: list[SquadExample]
    dev_features: list[SquadFeature]
    post: SquadPostprocessConfig
    head: HeadConfig = field(default_factory=lambda: HeadConfig(kind="span"))
    loss_name: str = "span loss"

    @classmethod
    def load(cls, name: str, data_dir: str, encoder: PairEncoder, *, doc_stride: int = 128,
             max_query_length: int = 64, null_threshold: float = 0.0) -> SquadData:  # fmt: skip
        fcfg = SquadFeatureConfig(max_seq_length=encoder.max_seq_length, doc_stride=doc_stride,
                                  max_query_length=max_query_length)  # fmt: skip
        train_f = build_squad_features(read_squad_json(_squad_file(name, data_dir, "train")), encoder, fcfg,
                                       is_training=True)  # fmt: skip
        dev_ex = read_squad_json(_squad_file(name, data_dir, "dev"))
        dev_f = build_squad_features(dev_ex, encoder, fcfg, is_training=False)
        if not train_f or not dev_f:
            raise UserError(f"--data-dir {data_dir}: the SQuAD train or dev file gives no features")
        post = SquadPostprocessConfig(
            version_2_with_negative=name == "squad2", null_score_diff_threshold=null_threshold
        )
        return cls(name=name, train=squad_tensors(train_f), eval_splits={"dev": squad_tensors(dev_f)},
                   dev_examples=dev_ex, dev_features=dev_f, post=post)  # fmt: skip

    def loss_sum(self, output: torch.Tensor, mb: Microbatch) -> torch.Tensor:
        """Mean of the start and end cross-entropies over the real tokens of each window."""
        logits = output.float().masked_fill(mb["attention_mask"][..., None] == 0, -1e4)
        start = F.cross_entropy(logits[..., 0], mb["start_positions"], reduction="sum")
        end = F.cross_entropy(logits[..., 1], mb["end_positions"], reduction="sum")
        return (start + end) / 2

    def score(self, outputs: Mapping[str, np.ndarray], out_dir: str | None) -> dict[str, Any]:
        out = outputs["dev"]
        preds = postprocess_squad(self.dev_examples, self.dev_features, out[..., 0], out[..., 1], self.post)
        v2 = self.post.version_2_with_negative
        scores = squad_evaluate([e.gold() for e in self.dev_examples], preds.predictions,
                                na_probs=preds.null_odds if v2 else None)  # fmt: skip
        files = []
        if out_dir is not None:
            files.append(str(write_squad_predictions(Path(out_dir) / "predictions.json", preds.predictions)))
            files.append(str(write_nbest(Path(out_dir) / "nbest_predictions.json", preds.nbest)))
            if v2:
                files.append(str(write_null_odds(Path(out_dir) / "null_odds.json", preds.null_odds)))
        metrics = {k: float(scores[k]) for k in ("exact_match", "f1")}
        return {
            "metrics": metrics,
            "details": {k: v for k, v in scores.items() if k not in metrics},
            "files": files,
        }


# --- RACE -------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class RaceData:
    """RACE: inputs ``[n, 4, s]``, labels ``[n]``; scored on dev and (headline) test when present."""

    name: str
    train: Tensors
    eval_splits: dict[str, Tensors]
    examples: dict[str, list[RaceExample]]
    head: HeadConfig = field(default_factory=lambda: HeadConfig(kind="multichoice", num_choices=NUM_CHOICES))
    loss_name: str = "ce loss"

    @classmethod
    def load(cls, name: str, data_dir: str, encoder: PairEncoder) -> RaceData:
        def tensors_of(examples: list[RaceExample]) -> Tensors:
            feats = build_race_features(examples, encoder)
            flat = encoding_tensors([c for f in feats for c in f.choices])
            t = {k: v.view(len(feats), NUM_CHOICES, -1) for k, v in flat.items()}
            t["labels"] = torch.tensor([f.label for f in feats], dtype=torch.long)
            return t

        splits = ["dev"] + (["test"] if (Path(data_dir) / "test").is_dir() else [])
        examples = {s: read_race(data_dir, s) for s in ["train", *splits]}
        return cls(name=name, train=tensors_of(examples["train"]),
                   eval_splits={s: tensors_of(examples[s]) for s in splits}, examples=examples)  # fmt: skip

    def loss_sum(self, output: torch.Tensor, mb: Microbatch) -> torch.Tensor:
        return F.cross_entropy(output.float(), mb["labels"], reduction="sum")

    def score(self, outputs: Mapping[str, np.ndarray], out_dir: str | None) -> dict[str, Any]:
        per_split, files = {}, []
        for s, out in outputs.items():
            ex, preds = self.examples[s], out.argmax(-1)
            per_split[s] = race_accuracy([e.subset for e in ex], preds, [e.label for e in ex])
            if out_dir is not None:
                letters = {e.uid: "ABCD"[int(p)] for e, p in zip(ex, preds, strict=True)}
                files.append(_write_json(Path(out_dir) / f"race-{s}-predictions.json", letters))
        head = "test" if "test" in per_split else "dev"
        return {"metrics": per_split[head], "details": {"split": head, **{f"{s}": m for s, m in per_split.items()}},
                "files": files}  # fmt: skip


def check_task_files(name: str, data_dir: str) -> None:
    """Before any work: ``data_dir`` exists and holds CLI task ``name``'s files (one line if not)."""
    if not Path(data_dir).is_dir():
        raise UserError(f"--data-dir {data_dir}: no such directory")
    if name in ("squad", "squad2"):
        for split in ("train", "dev"):
            _squad_file(name, data_dir, split)
    elif name == "race":
        for split in ("train", "dev"):
            if not (Path(data_dir) / split).is_dir():
                raise UserError(f"--data-dir {data_dir}: missing RACE directory {Path(data_dir) / split}")
    else:
        resolve_task_dir(name, data_dir)


def load_task_data(name: str, data_dir: str, encoder: PairEncoder, **squad_options: Any) -> TaskData:
    """The :class:`~finetune.tasks.TaskData` of CLI task ``name``."""
    check_task_files(name, data_dir)
    if name in ("squad", "squad2"):
        return SquadData.load(name, data_dir, encoder, **squad_options)
    if name == "race":
        return RaceData.load(name, data_dir, encoder)
    return GlueData.load(name, data_dir, encoder)
