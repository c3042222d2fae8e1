"""The library that runs the frozen fp32 base GEMMs on the CPU (``--cpu-gemm``): MKL or oneDNN.

PyTorch sends an fp32 ``torch.mm`` on the CPU to MKL. On CPUs other than Intel's, MKL dispatches
its AVX2 kernels (AVX-512 only on Intel), and on an AVX-512 AMD EPYC those run fp32 GEMMs of our
shapes at 104-172 GFLOP/s where oneDNN (``mkldnn::_linear_pointwise``, the kernel Inductor's CPU
freezing uses) runs them at 237-366; on an AVX2 EPYC oneDNN is 20-40% faster on the wide ones and
no slower on the others; on Intel the two are equally fast. Both are exact fp32 (oneDNN's default
``strict`` math mode: no bf16 or tf32 downconversion), summing the same products in their own
order, so results agree to fp32 rounding.

``auto`` resolves from the CPU's vendor alone (``/proc/cpuinfo``), never from a timing, so a run
and its resume on the same host run the same kernels and stay bitwise equal. Only the GEMMs whose
weight gets no gradient use it (LoRA's adapted linears, the frozen output layer): their inputs and
outputs are plain fp32 tensors, and the weight is read as it lies (no packed copy: the transposed
view of the backward GEMM is reordered by oneDNN per call, at most 30% slower than a packed one).
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path
from typing import Literal

import torch

from pretrain.config import CpuGemm

GemmLibrary = Literal["mkl", "onednn"]  # what "auto" resolves to ("mkl": torch's own matmul)
_X86 = ("x86_64", "amd64", "i686", "i386")


@functools.cache
def cpu_vendor() -> str | None:
    """The CPU's ``vendor_id`` (``GenuineIntel``, ``AuthenticAMD``, ...) from ``/proc/cpuinfo``, or
    None where there is none (not Linux, not x86)."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "vendor_id":
            return value.strip()
    return None


@functools.cache
def onednn_available() -> bool:
    """Whether this PyTorch build has oneDNN's fp32 linear (x86 builds with ``USE_MKLDNN``)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        return hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except RuntimeError:  # the op namespace failed to load
        return False


def resolve(choice: CpuGemm) -> GemmLibrary:
    """``auto``: oneDNN on an x86 CPU whose vendor is not Intel (where MKL's fp32 kernels are its
    AVX2 ones) when this build has it, else MKL; ``mkl``/``onednn`` as asked (``onednn`` on a build
    without it is refused by :func:`check_available`)."""
    if choice != "auto":
        return choice
    x86 = platform.machine().lower() in _X86
    vendor = cpu_vendor()
    return "onednn" if x86 and vendor not in (None, "GenuineIntel") and onednn_available() else "mkl"


def check_available(choice: CpuGemm) -> None:
    """Refuse ``--cpu-gemm onednn`` (one line, before any work) on a build without oneDNN."""
    from pretrain.utils.errors import UserError

    if choice == "onednn" and not onednn_available():
        raise UserError("--cpu-gemm onednn: this PyTorch build has no oneDNN (mkldnn) fp32 linear; "
                        "use --cpu-gemm mkl or auto")  # fmt: skip


def runs_onednn(library: GemmLibrary, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`mm_weight_t` / :func:`mm_weight` run oneDNN for these operands: ``library``
    oneDNN, fp32 tensors on the CPU (on a GPU, or in bf16/fp16, torch's own matmul runs as before)."""
    return library == "onednn" and x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32


def mm_weight_t(
    x: torch.Tensor, weight: torch.Tensor, library: GemmLibrary, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x [N, in] @ weight [out, in]^T (+ bias [out])`` -> a new ``[N, out]`` (a linear's forward GEMM)."""
    if runs_onednn(library, x, weight):  # a bias has the weight's dtype (lora_linear.fast_path_ok)
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")  # type: ignore[no-any-return]
    return torch.mm(x, weight.t()) if bias is None else torch.addmm(bias, x, weight.t())


def mm_weight(g: torch.Tensor, weight: torch.Tensor, library: GemmLibrary) -> torch.Tensor:
    """``g [N, out] @ weight [out, in]`` -> a new ``[N, in]`` (the input gradient of a linear)."""
    if runs_onednn(library, g, weight):
        return torch.ops.mkldnn._linear_pointwise(g, weight.t(), None, "none", [], "")  # type: ignore[no-any-return]
    return torch.mm(g, weight)
