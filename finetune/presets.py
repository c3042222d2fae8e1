"""Per-task finetuning hyperparameters: the paper's Table 6 (appendix A) and documented defaults.

Table 6 (Shoeybi et al. 2019) for the 336M / 1.3B / 3.8B BERT models:

========  ==================  ===================  ======
task      batch size          learning rate        epochs
========  ==================  ===================  ======
MNLI      128 / 128 / 128     1e-5 / 1e-5 / 1e-5   10
QQP       128 / 128 / 256     5e-5 / 3e-5 / 4e-5   12
SQuAD1.1  64 / 48 / 48        3e-5 / 3e-5 / 1e-5   2
SQuAD2.0  48 / 64 / 48        3e-5 / 3e-5 / 1e-5   2
RACE      32 / 16 / 32        2e-5 / 1e-5 / 2e-5   3
========  ==================  ===================  ======

The other GLUE tasks are not in the paper; their defaults follow the original BERT recipe
(batch 32, lr 2e-5, 3 epochs; 10 epochs for the small RTE, MRPC, STS-B and WNLI sets) and are the
same for every size. Sequence lengths are not in Table 6: 128 for GLUE, 384 with stride 128 for
SQuAD (BERT's), 512 for RACE (upstream Megatron's example). All runs use AdamW with weight decay
0.1, linear decay to 0 after a warmup of 6.5% of the iterations (upstream Megatron's finetuning
scripts), gradient clipping 1.0 and dropout 0.1.
"""

from __future__ import annotations

from dataclasses import dataclass

from pretrain.utils.errors import UserError

SIZES = ("336m", "1.3b", "3.8b")
GLUE_NAMES = ("mnli", "qqp", "cola", "sst2", "mrpc", "stsb", "qnli", "rte", "wnli")
TASK_NAMES = (*GLUE_NAMES, "squad", "squad2", "race")


@dataclass(frozen=True, kw_only=True)
class Preset:
    """Hyperparameters of one task at one model size."""

    global_batch_size: int
    lr: float
    epochs: float
    seq_length: int
    weight_decay: float = 0.1
    warmup_fraction: float = 0.065
    from_paper: bool = False


def _table6(
    batches: tuple[int, int, int], lrs: tuple[float, float, float], epochs: int, seq: int
) -> dict[str, Preset]:
    return {
        size: Preset(global_batch_size=b, lr=lr, epochs=epochs, seq_length=seq, from_paper=True)
        for size, b, lr in zip(SIZES, batches, lrs, strict=True)
    }


def _same(batch: int, lr: float, epochs: int, seq: int = 128) -> dict[str, Preset]:
    return {size: Preset(global_batch_size=batch, lr=lr, epochs=epochs, seq_length=seq) for size in SIZES}


PRESETS: dict[str, dict[str, Preset]] = {
    "mnli": _table6((128, 128, 128), (1e-5, 1e-5, 1e-5), 10, 128),
    "qqp": _table6((128, 128, 256), (5e-5, 3e-5, 4e-5), 12, 128),
    "squad": _table6((64, 48, 48), (3e-5, 3e-5, 1e-5), 2, 384),
    "squad2": _table6((48, 64, 48), (3e-5, 3e-5, 1e-5), 2, 384),
    "race": _table6((32, 16, 32), (2e-5, 1e-5, 2e-5), 3, 512),
    "cola": _same(32, 2e-5, 3),
    "sst2": _same(32, 2e-5, 3),
    "qnli": _same(32, 2e-5, 3),
    "mrpc": _same(32, 2e-5, 10),
    "stsb": _same(32, 2e-5, 10),
    "rte": _same(32, 2e-5, 10),
    "wnli": _same(32, 2e-5, 10),
}


def get_preset(task: str, size: str = "336m") -> Preset:
    """The preset of ``task`` (one of :data:`TASK_NAMES`) for model ``size`` (one of :data:`SIZES`)."""
    if task not in PRESETS:
        raise UserError(f"unknown finetuning task {task!r}; expected one of {', '.join(TASK_NAMES)}")
    if size not in SIZES:
        raise UserError(f"--preset {size!r}: expected one of {', '.join(SIZES)}")
    return PRESETS[task][size]
