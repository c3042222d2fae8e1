"""Descriptions of the nine GLUE tasks: files, TSV column layouts, labels, metrics, HF names.

Label conventions follow upstream Megatron where it had the task (MNLI: contradiction 0,
entailment 1, neutral 2) and the GLUE files otherwise (the label strings of the TSV, in the order
of ``labels``); the label strings are also what the GLUE server expects in submission files.
"""

from __future__ import annotations

from dataclasses import dataclass

from finetune.metrics import GLUE_METRICS
from pretrain.utils.errors import UserError


@dataclass(frozen=True, kw_only=True)
class TsvLayout:
    """Where the fields of one GLUE TSV file are.

    ``header`` lists ``(column, name)`` pairs the header row must have (``None``: the file has no
    header row). Column ``-1`` is the last column. ``id_col`` ``None`` means the file has no id
    column and the 0-based data-row number is used instead.
    """

    header: tuple[tuple[int, str], ...] | None
    num_cols: int
    a_col: int
    b_col: int | None = None
    label_col: int | None = None
    id_col: int | None = 0


@dataclass(frozen=True, kw_only=True)
class GlueSplit:
    """One file of a task: ``train``, a dev split (labelled) or a test split (no labels)."""

    name: str
    file: str
    layout: TsvLayout
    hf_split: str
    metric_suffix: str = ""  # MNLI: "_m" / "_mm", appended to metric names
    submission_file: str | None = None  # test splits: the GLUE server's file name


@dataclass(frozen=True, kw_only=True)
class GlueTask:
    """A GLUE task: ``num_labels`` 1 means regression (STS-B) and ``labels`` is empty."""

    name: str
    glue_dir: str  # directory name inside the official glue_data/
    num_labels: int
    labels: tuple[str, ...]
    metrics: tuple[str, ...]
    splits: tuple[GlueSplit, ...]
    hf_columns: tuple[str, str | None]
    # HF label id -> our label id (None: identical), and the HF ClassLabel names it assumes.
    hf_label_map: tuple[int, ...] | None = None
    hf_label_names: tuple[str, ...] | None = None

    @property
    def is_regression(self) -> bool:
        return self.num_labels == 1

    def split(self, name: str) -> GlueSplit:
        for s in self.splits:
            if s.name == name:
                return s
        raise UserError(f"task {self.name} has no split {name!r}; expected one of {self.split_names}")

    @property
    def split_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.splits)

    @property
    def dev_splits(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.splits if s.name.startswith("dev"))

    @property
    def test_splits(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.splits if s.name.startswith("test"))


def _std_splits(
    train_dev: TsvLayout, test: TsvLayout, submission: str, *, dev_names: tuple[str, ...] = ("dev",)
) -> tuple[GlueSplit, ...]:
    """train/dev/test splits of a task whose dev files share the train layout."""
    if dev_names == ("dev",):
        devs = [GlueSplit(name="dev", file="dev.tsv", layout=train_dev, hf_split="validation")]
        tests = [
            GlueSplit(name="test", file="test.tsv", layout=test, hf_split="test", submission_file=submission)
        ]
    else:  # MNLI: matched and mismatched
        devs = [
            GlueSplit(
                name=f"dev_{k}",
                file=f"dev_{k}.tsv",
                layout=train_dev,
                hf_split=f"validation_{k}",
                metric_suffix=sfx,
            )
            for k, sfx in (("matched", "_m"), ("mismatched", "_mm"))
        ]
        tests = [
            GlueSplit(
                name=f"test_{k}",
                file=f"test_{k}.tsv",
                layout=test,
                hf_split=f"test_{k}",
                submission_file=f"{submission}-{sfx}.tsv",
            )
            for k, sfx in (("matched", "m"), ("mismatched", "mm"))
        ]
    train = GlueSplit(name="train", file="train.tsv", layout=train_dev, hf_split="train")
    return (train, *devs, *tests)


def _sentence_pair_task(name: str, glue_dir: str, labels: tuple[str, ...], a: str, b: str) -> GlueTask:
    """QNLI / RTE / WNLI: ``index a b label``; test files lack the label."""
    head = ((0, "index"), (1, a), (2, b))
    return GlueTask(
        name=name,
        glue_dir=glue_dir,
        num_labels=len(labels),
        labels=labels,
        metrics=GLUE_METRICS[name],
        splits=_std_splits(
            TsvLayout(header=(*head, (3, "label")), num_cols=4, a_col=1, b_col=2, label_col=3),
            TsvLayout(header=head, num_cols=3, a_col=1, b_col=2),
            f"{glue_dir}.tsv",
        ),
        hf_columns=(a, b),
    )


_BINARY = ("0", "1")
_NLI2 = ("entailment", "not_entailment")
_STSB_HEAD = ((0, "index"), (7, "sentence1"), (8, "sentence2"))


def _mnli() -> GlueTask:
    return GlueTask(
        name="mnli",
        glue_dir="MNLI",
        num_labels=3,
        labels=("contradiction", "entailment", "neutral"),
        metrics=GLUE_METRICS["mnli"],
        splits=_std_splits(
            TsvLayout(
                header=((0, "index"), (8, "sentence1"), (9, "sentence2"), (-1, "gold_label")),
                num_cols=-1,  # train has 12 columns, dev 16: checked against the header
                a_col=8,
                b_col=9,
                label_col=-1,
            ),
            TsvLayout(
                header=((0, "index"), (8, "sentence1"), (9, "sentence2")), num_cols=-1, a_col=8, b_col=9
            ),
            "MNLI",
            dev_names=("dev_matched", "dev_mismatched"),
        ),
        hf_columns=("premise", "hypothesis"),
        hf_label_map=(1, 2, 0),
        hf_label_names=("entailment", "neutral", "contradiction"),
    )


def _qqp() -> GlueTask:
    return GlueTask(
        name="qqp",
        glue_dir="QQP",
        num_labels=2,
        labels=_BINARY,
        metrics=GLUE_METRICS["qqp"],
        splits=_std_splits(
            TsvLayout(
                header=((0, "id"), (3, "question1"), (4, "question2"), (5, "is_duplicate")),
                num_cols=6,
                a_col=3,
                b_col=4,
                label_col=5,
            ),
            TsvLayout(header=((0, "id"), (1, "question1"), (2, "question2")), num_cols=3, a_col=1, b_col=2),
            "QQP.tsv",
        ),
        hf_columns=("question1", "question2"),
    )


def _cola() -> GlueTask:
    return GlueTask(
        name="cola",
        glue_dir="CoLA",
        num_labels=2,
        labels=_BINARY,
        metrics=GLUE_METRICS["cola"],
        splits=_std_splits(
            # source, label, original annotation, sentence -- no header row.
            TsvLayout(header=None, num_cols=4, a_col=3, label_col=1, id_col=None),
            TsvLayout(header=((0, "index"), (1, "sentence")), num_cols=2, a_col=1),
            "CoLA.tsv",
        ),
        hf_columns=("sentence", None),
    )


def _sst2() -> GlueTask:
    return GlueTask(
        name="sst2",
        glue_dir="SST-2",
        num_labels=2,
        labels=_BINARY,
        metrics=GLUE_METRICS["sst2"],
        splits=_std_splits(
            TsvLayout(header=((0, "sentence"), (1, "label")), num_cols=2, a_col=0, label_col=1, id_col=None),
            TsvLayout(header=((0, "index"), (1, "sentence")), num_cols=2, a_col=1),
            "SST-2.tsv",
        ),
        hf_columns=("sentence", None),
    )


def _mrpc() -> GlueTask:
    return GlueTask(
        name="mrpc",
        glue_dir="MRPC",
        num_labels=2,
        labels=_BINARY,
        metrics=GLUE_METRICS["mrpc"],
        splits=_std_splits(
            TsvLayout(
                header=((0, "Quality"), (3, "#1 String"), (4, "#2 String")),
                num_cols=5,
                a_col=3,
                b_col=4,
                label_col=0,
                id_col=None,
            ),
            TsvLayout(
                header=((0, "index"), (3, "#1 String"), (4, "#2 String")), num_cols=5, a_col=3, b_col=4
            ),
            "MRPC.tsv",
        ),
        hf_columns=("sentence1", "sentence2"),
    )


def _stsb() -> GlueTask:
    return GlueTask(
        name="stsb",
        glue_dir="STS-B",
        num_labels=1,
        labels=(),
        metrics=GLUE_METRICS["stsb"],
        splits=_std_splits(
            TsvLayout(header=(*_STSB_HEAD, (9, "score")), num_cols=10, a_col=7, b_col=8, label_col=9),
            TsvLayout(header=_STSB_HEAD, num_cols=9, a_col=7, b_col=8),
            "STS-B.tsv",
        ),
        hf_columns=("sentence1", "sentence2"),
    )


def _build_tasks() -> dict[str, GlueTask]:
    tasks = [
        _mnli(),
        _qqp(),
        _cola(),
        _sst2(),
        _mrpc(),
        _stsb(),
        _sentence_pair_task("qnli", "QNLI", _NLI2, "question", "sentence"),
        _sentence_pair_task("rte", "RTE", _NLI2, "sentence1", "sentence2"),
        _sentence_pair_task("wnli", "WNLI", _BINARY, "sentence1", "sentence2"),
    ]
    return {t.name: t for t in tasks}


GLUE_TASKS: dict[str, GlueTask] = _build_tasks()


def glue_task(name: str) -> GlueTask:
    """The :class:`GlueTask` called ``name`` (``mnli``, ``qqp``, ``cola``, ``sst2``, ...)."""
    key = name.lower().replace("-", "")
    if key not in GLUE_TASKS:
        raise UserError(f"unknown GLUE task {name!r}; expected one of {', '.join(GLUE_TASKS)}")
    return GLUE_TASKS[key]
