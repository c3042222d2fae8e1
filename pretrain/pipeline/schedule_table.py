"""Pipeline schedules as tables: the per-rank sequence of (forward|backward, microbatch, chunk).

Pure functions, no processes. One executor (:mod:`pretrain.pipeline.schedules`) runs any table.

* no pipelining: ``F0 B0 F1 B1 ...`` (gradient accumulation on one stage);
* 1F1B: warmup ``min(p - r - 1, m)`` forwards, steady one-forward-one-backward, cooldown;
* interleaved 1F1B (V chunks): microbatches visited in groups of ``g`` (default p): for each
  group, for chunk 0..V-1, for each microbatch of the group; backward visits chunks in reverse;
  warmup ``min((p - r - 1) * 2 + (V - 1) * g, m V)``;
* forward-only: every forward in order (evaluation);
* all-forward-then-all-backward (GPipe), for comparison of stored activations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pretrain.utils.errors import UserError


@dataclass(frozen=True)
class Action:
    kind: Literal["F", "B"]
    microbatch: int
    chunk: int = 0

    def __repr__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


def virtual_order(m: int, vp: int, group: int) -> list[tuple[int, int]]:
    """Forward visiting order of (microbatch, chunk) for interleaving (last group may be short)."""
    order = []
    for start in range(0, m, group):
        ids = range(start, min(start + group, m))
        order += [(mb, c) for c in range(vp) for mb in ids]
    return order


def warmup_count(*, p: int, r: int, m: int, vp: int = 1, group: int | None = None) -> int:
    """Number of warmup forwards on rank ``r`` (Megatron's formulas)."""
    if vp == 1:
        return min(p - r - 1, m)
    g = p if group is None else group
    return min((p - r - 1) * 2 + (vp - 1) * g, m * vp)


def _check(p: int, r: int, m: int, vp: int) -> None:
    if m <= 0:
        raise UserError(f"number of microbatches must be positive, got {m}")
    if not 0 <= r < p:
        raise ValueError(f"rank {r} outside pipeline of size {p}")
    if vp < 1:
        raise UserError(f"--vp must be >= 1, got {vp}")


def one_f_one_b(*, p: int, r: int, m: int) -> list[Action]:
    """1F1B without interleaving for pipeline rank ``r`` (p = 1 gives no pipelining)."""
    _check(p, r, m, 1)
    w = warmup_count(p=p, r=r, m=m)
    table = [Action("F", i) for i in range(w)]
    for i in range(m - w):
        table += [Action("F", w + i), Action("B", i)]
    return table + [Action("B", i) for i in range(m - w, m)]


def interleaved(*, p: int, r: int, m: int, vp: int, group: int | None = None) -> list[Action]:
    """Interleaved 1F1B with ``vp`` chunks per stage and microbatch group size ``group`` (p)."""
    _check(p, r, m, vp)
    g = p if group is None else group
    if g < p:
        raise UserError(f"microbatch group size {g} must be >= pipeline size {p} for interleaving")
    fwd = virtual_order(m, vp, g)
    bwd = [(mb, vp - 1 - c) for mb, c in fwd]
    total, w = m * vp, warmup_count(p=p, r=r, m=m, vp=vp, group=g)
    table = [Action("F", *fwd[k]) for k in range(w)]
    for k in range(total - w):
        table += [Action("F", *fwd[w + k]), Action("B", *bwd[k])]
    return table + [Action("B", *bwd[k]) for k in range(total - w, total)]


def all_forward_all_backward(*, m: int, vp: int = 1, group: int | None = None, p: int = 1) -> list[Action]:
    """GPipe-style F-then-B: every forward, then every backward (stores all m activations)."""
    fwd = forward_only(m=m, vp=vp, group=group, p=p)
    return fwd + [Action("B", a.microbatch, vp - 1 - a.chunk) for a in fwd]


def forward_only(*, m: int, vp: int = 1, group: int | None = None, p: int = 1) -> list[Action]:
    """Every forward, in the order the training schedule would run them."""
    if vp == 1:
        return [Action("F", i) for i in range(m)]
    return [Action("F", mb, c) for mb, c in virtual_order(m, vp, p if group is None else group)]


def build_table(
    *, p: int, r: int, m: int, vp: int = 1, group: int | None = None, train: bool = True, kind: str = "1f1b"
) -> list[Action]:
    """The table the executor runs on pipeline rank ``r`` (``kind``: ``1f1b`` or ``fthenb``)."""
    if not train:
        return forward_only(m=m, vp=vp, group=group, p=p)
    if kind == "fthenb":
        return all_forward_all_backward(m=m, vp=vp, group=group, p=p)
    if kind != "1f1b":
        raise UserError(f"unknown pipeline schedule {kind!r} (expected 1f1b or fthenb)")
    return one_f_one_b(p=p, r=r, m=m) if vp == 1 else interleaved(p=p, r=r, m=m, vp=vp, group=group)
