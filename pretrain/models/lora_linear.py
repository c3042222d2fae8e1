"""A whole LoRA-adapted linear of frozen base weights (fp32, bf16 or fp16) as one autograd node.

``y = x W^T (+ b) + scaling * z B_j^T`` with ``z = x A^T`` ``[N, n r]``, where output row ``o``
of slice ``j`` reads only its slice's block ``z[:, j r:(j+1) r]`` (fused QKV: q, k, v; SwiGLU
fc1: gate, up). Autograd over the plain ops of :mod:`pretrain.models.lora_ops` spends time the
frozen base does not need, and this node does not:

* the B side runs per contiguous row range of one slice, not as one GEMM with the block-diagonal
  ``[out, n r]`` spread of ``B`` (whose zero blocks cost 2x the fc1 and 3x the QKV B-side flops);
* the low-rank update is added in place into the base GEMM's output (``addmm_`` with
  ``alpha=scaling``): no copy of ``y``, no scaled copy of ``B``; on one rank without a bias it
  is written first and the base GEMM accumulates onto it (one read-modify-write pass of ``y``
  less; the sum in another order, equal up to fp32 rounding) where MKL runs the base GEMMs;
  oneDNN (``--cpu-gemm``, :mod:`pretrain.models.cpu_gemm`) writes a new ``y`` and the update is added after;
* backward adds the adapter's input gradient into the base one in place (``gx.addmm_(gz, A)``)
  instead of summing two ``[N, in]`` tensors, and skips the input gradient where the input needs
  none (the first layer's QKV reads the frozen embedding);
* the base weight gets no gradient (the caller only uses this node when it is frozen).

With a bf16 or fp16 base the base GEMMs run in its dtype and the adapter in fp32, as on the plain
path and in PEFT: ``x`` is cast once (and that copy kept for ``A``'s gradient), the update
``scaling z B_j^T`` is added to the upcast base output and the sum rounded once; the adapter's
input gradient is rounded to the base dtype and then added to the base one (autograd's sum of the
two paths' gradients). The saving is in the passes (no scaled copies, no block-diagonal ``B``, one
cast of ``g``), not the rounding.

Values equal the plain formula up to fp32 rounding (the same products, summed by the same GEMMs
in a different grouping). Collectives, over ``group`` (None or one rank: none): column-parallel
(``column=True``, ``x`` replicated, ``A`` replicated, ``W``/``B`` this rank's rows) all-reduces
the base input gradient and ``dz`` in backward (f on the input and on ``z``, as the plain path);
row-parallel (``x``, ``W`` and ``A`` split along the input, ``B`` replicated) all-reduces ``x W^T``
and ``z`` in forward (g) and nothing in backward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from pretrain.models.cpu_gemm import GemmLibrary, mm_weight, mm_weight_t, runs_onednn
from pretrain.models.lora_ops import LoraWeight, add_low_rank, block_diagonal_b, dropped
from pretrain.parallel.rng import RNGStatesTracker
from pretrain.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from pretrain.tensor_parallel.mappings import (
    ProcessGroup,
    all_reduce,
    copy_to_tp_region,
    gather_from_tp_region,
    group_size,
    reduce_from_tp_region,
)

Ranges = tuple[tuple[int, int, int], ...]  # (first row, end row, slice j) of the output rows
_BASE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def slice_ranges(slice_mask: torch.Tensor) -> Ranges:
    """Runs of consecutive output rows of one slice, from ``slice_mask [out, n]`` (1 where row
    ``o`` is in slice ``j``): e.g. fc1 ``((0, f, 0), (f, 2 f, 1))``, QKV with two groups six runs."""
    owner = slice_mask.argmax(dim=1).tolist()
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(owner) + 1):
        if i == len(owner) or owner[i] != owner[start]:
            runs.append((start, i, owner[start]))
            start = i
    return tuple(runs)


class _LoraLinear(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, a: torch.Tensor,
        b: torch.Tensor, ranges: Ranges, scaling: float, group: ProcessGroup | None, column: bool,
        gemm: GemmLibrary,
    ) -> torch.Tensor:  # fmt: skip
        xa = x if x.dtype == a.dtype else x.to(a.dtype)  # the adapter runs in its own dtype (PEFT casts too)
        z = torch.mm(xa, a.t())  # [N, n r]: every slice's A in one GEMM
        if (
            x.dtype == a.dtype
            and bias is None
            and group_size(group) == 1
            and not runs_onednn(gemm, x, weight)
        ):
            # the low-rank part first, torch's base GEMM adds onto it (no second pass over y)
            y = x.new_empty(x.shape[0], weight.shape[0])
            _low_rank_into(y, z, b, ranges, scaling, accumulate=False)
            y.addmm_(x, weight.t())
        else:  # oneDNN's linear writes a new y (it cannot accumulate into one)
            y = mm_weight_t(x, weight, gemm, bias)
            if not column:  # g: the split input's partial products summed over the group
                all_reduce(y, group)
                all_reduce(z, group)
            if y.dtype == z.dtype:
                _low_rank_into(y, z, b, ranges, scaling, accumulate=True)
            else:  # a bf16 base: PEFT's rounding (the update added in fp32, the sum rounded once)
                update = z.new_empty(y.shape)  # [N, out] in the adapter's dtype
                _low_rank_into(update, z, b, ranges, scaling, accumulate=False)
                y.add_(update)  # computed in the common dtype (fp32), rounded once into y
        ctx.save_for_backward(xa, weight, a, b, z)
        ctx.ranges, ctx.scaling, ctx.group, ctx.column, ctx.gemm = ranges, scaling, group, column, gemm
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        xa, weight, a, b, z = ctx.saved_tensors
        r, s = b.shape[1], ctx.scaling
        ge = g if g.dtype == z.dtype else g.to(z.dtype)  # [N, out]: the adapter's gradient in its dtype
        gz = torch.empty_like(z)  # [N, n r]
        gb_t = b.new_empty(r, b.shape[0])  # [r, out]: z^T g reads g row-major (g^T z is slower)
        started: set[int] = set()
        for lo, hi, j in ctx.ranges:
            g_rows, z_j, gz_j = ge[:, lo:hi], z[:, j * r : (j + 1) * r], gz[:, j * r : (j + 1) * r]
            gz_j.addmm_(g_rows, b[lo:hi], beta=0.0 if j not in started else 1.0, alpha=s)
            gb_t[:, lo:hi].addmm_(z_j.t(), g_rows, beta=0.0, alpha=s)
            started.add(j)
        for j in range(gz.shape[1] // r):  # a slice with no local rows: no gradient from here
            if j not in started:
                gz[:, j * r : (j + 1) * r].zero_()
        gx = None
        if ctx.needs_input_grad[0]:
            gx = mm_weight(g, weight, ctx.gemm)
            if ctx.column:  # f on the input: the base rows of every rank
                all_reduce(gx, ctx.group)
        if ctx.column:  # f on z: the replicated A sees the gradient of every rank's B rows
            all_reduce(gz, ctx.group)
        ga = torch.mm(gz.t(), xa)
        if gx is not None and gx.dtype == gz.dtype:
            gx.addmm_(gz, a)
        elif gx is not None:  # the adapter's input gradient rounded to the base dtype, then summed
            gx.add_(torch.mm(gz, a).to(gx.dtype))
        return gx, None, None, ga, gb_t.t().contiguous(), None, None, None, None, None


def _low_rank_into(
    out: torch.Tensor, z: torch.Tensor, b: torch.Tensor, ranges: Ranges, scaling: float, *, accumulate: bool
) -> None:  # fmt: skip
    """``out[:, rows of slice j] (+)= scaling z_j B[rows]^T`` in place, one ``addmm_`` per run of
    rows (``out [N, out]`` in ``z``'s dtype, ``z [N, n r]``, ``B [out, r]``; the runs cover every
    row): written over ``out`` (its content ignored) unless ``accumulate``."""
    r, beta = b.shape[1], 1.0 if accumulate else 0.0
    for lo, hi, j in ranges:
        out[:, lo:hi].addmm_(z[:, j * r : (j + 1) * r], b[lo:hi].t(), beta=beta, alpha=scaling)


def lora_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor, *,
    ranges: Ranges, scaling: float, group: ProcessGroup | None, column: bool, gemm: GemmLibrary = "mkl",
) -> torch.Tensor:  # fmt: skip
    """``x [..., in]`` -> ``[..., out]`` (see the module docstring): ``weight [out, in]``, ``bias
    [out]`` or None (column-parallel only), ``a [n r, in]``, ``b [out, r]``, ``ranges`` the output
    rows of each slice (:func:`slice_ranges`), ``gemm`` the library of the fp32 base GEMMs on the
    CPU (:mod:`pretrain.models.cpu_gemm`). Only for a frozen base and fp32 adapters (:func:`fast_path_ok`)."""
    y = _LoraLinear.apply(
        x.reshape(-1, x.shape[-1]), weight, bias, a, b, ranges, scaling, group, column, gemm
    )
    return y.view(*x.shape[:-1], y.shape[-1])  # type: ignore[no-any-return]


def fast_path_ok(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, a: torch.Tensor,
                 dropout: float, training: bool) -> bool:  # fmt: skip
    """Whether :func:`lora_linear` computes this adapted linear: a frozen base (no weight or bias
    gradient wanted), the input in the base's floating dtype (fp32, bf16 or fp16), fp32 adapters,
    and no adapter dropout while training."""
    frozen = not weight.requires_grad and (bias is None or not bias.requires_grad)
    base_dtype = x.dtype == weight.dtype and (bias is None or bias.dtype == weight.dtype)
    dtypes = base_dtype and x.dtype in _BASE_DTYPES and a.dtype == torch.float32
    return frozen and dtypes and (dropout == 0.0 or not training)


class LoraColumnParallelLinear(ColumnParallelLinear):
    """A :class:`ColumnParallelLinear` with an adapter: ``lora_A`` ``[n r, in]`` (replicated),
    ``lora_B`` ``[out/t, r]`` (this rank's base rows). ``x [..., in]`` -> ``[..., out/t]``."""

    lora_A: LoraWeight
    lora_B: LoraWeight
    lora_slice_mask: torch.Tensor  # [out/t, n]: 1 where a local row belongs to slice j
    lora_ranges: Ranges  # the same, as runs of rows
    lora_scaling: float
    lora_dropout: float
    lora_gemm: GemmLibrary  # the base GEMMs' library on the CPU (ModelConfig.cpu_gemm, resolved)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.lora_A.weight, self.lora_B.weight
        if not self.sequence_parallel and fast_path_ok(x, self.weight, self.bias, a, self.lora_dropout,
                                                       self.training):  # fmt: skip
            y = lora_linear(x, self.weight, self.bias, a, b, ranges=self.lora_ranges, scaling=self.lora_scaling,
                            group=self.group, column=True, gemm=self.lora_gemm)  # fmt: skip
            return gather_from_tp_region(y, self.group) if self.gather_output else y
        y = super().forward(x)
        n = self.lora_slice_mask.shape[1]
        xf = x.to(a.dtype)
        if self.lora_dropout > 0.0 and self.training:  # one mask per slice, as PEFT's per module
            z = torch.cat([F.linear(dropped(xf, self.lora_dropout, True, None), aj) for aj in a.chunk(n)], -1)
        else:
            z = F.linear(xf, a)  # all slices in one GEMM: [..., n r]
        # f: the replicated A sees the gradient of every rank's B rows
        z = copy_to_tp_region(z, self.group)
        # each B row reads only its slice's block of z: B spread block-diagonally [out/t, n r]
        return add_low_rank(y, z, block_diagonal_b(b, self.lora_slice_mask), self.lora_scaling)


class LoraRowParallelLinear(RowParallelLinear):
    """A :class:`RowParallelLinear` with an adapter: ``lora_A`` ``[r, in/t]`` (split like the base
    input), ``lora_B`` ``[out, r]`` (replicated). ``x [..., in/t]`` -> ``[..., out]``."""

    lora_A: LoraWeight
    lora_B: LoraWeight
    lora_ranges: Ranges  # one run: every output row reads the one A
    lora_scaling: float
    lora_dropout: float
    lora_rng: RNGStatesTracker
    lora_gemm: GemmLibrary  # as LoraColumnParallelLinear's

    def forward_no_bias(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            raise NotImplementedError("LoRA on a row-parallel linear needs input_is_parallel=True")
        a, b = self.lora_A.weight, self.lora_B.weight
        if not self.sequence_parallel and fast_path_ok(
            x, self.weight, None, a, self.lora_dropout, self.training
        ):
            return lora_linear(x, self.weight, None, a, b, ranges=self.lora_ranges, scaling=self.lora_scaling,
                               group=self.group, column=False, gemm=self.lora_gemm)  # fmt: skip
        y = super().forward_no_bias(x)
        xj = dropped(x.to(a.dtype), self.lora_dropout, self.training, self.lora_rng)
        z = reduce_from_tp_region(F.linear(xj, a), self.group)
        return add_low_rank(y, z, b, self.lora_scaling)
