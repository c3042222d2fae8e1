"""Fused elementwise kernels (``--fused-kernels``): RMSNorm (frozen or trained) and SwiGLU, each
forward and gradient compiled into one loop with ``torch.compile``. The RoPE split of the QKV
output stays an eager node (:func:`pretrain.models.rotary.split_rotate_qkv`): compiled, it saved
too little of a step to be worth another compiled region (measured in the README's "LoRA training
step against transformers + PEFT").

Megatron fuses the same regions (``jit_fuser``: ``torch.compile``, or TorchScript on older
PyTorch; ``--bias-swiglu-fusion``, ``--apply-rope-fusion``, Transformer Engine's fused norms). In
eager PyTorch each of them is several passes over ``[tokens, width]`` tensors: the input gradient
of a frozen RMSNorm is five, SwiGLU's backward four, where one loop reads each input once and
writes each output once. On a CPU they are memory-bound, so the fused loop is 2-4x faster (the
measurements are in ``benchmarks/bench_lora.py``'s README row).

The functions here are the plain math of the eager paths they replace (same products and sums,
in the same order); a compiled loop may still round differently in the last bit (it may contract
a product and a sum into one FMA, and it sums a mean in another order), which is why the option is
``numerics`` in the model-options table and off by default. They are traced without autograd:
the custom ``autograd.Function`` s of :mod:`pretrain.models.norms`, :mod:`~pretrain.models.swiglu`
and :mod:`~pretrain.models.rotary` call them in their forward and backward.

Compilation happens on the first call of each kernel in a process (seconds; Inductor's on-disk
cache makes later processes faster), for the shapes of that call; the first new shape compiles
once more with dynamic sizes (``torch.compile``'s automatic dynamic shapes), so further sequence
lengths or batch sizes do not compile again. :func:`check_compiler` refuses the flag in one line before any work where
Inductor's C++ compiler is missing; a compilation that fails anyway is a :class:`UserError`
naming the flag too.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.nn.functional as F

from pretrain.utils.errors import UserError

__all__ = [
    "check_compiler",
    "rms_norm_backward",
    "rms_norm_forward",
    "rms_norm_train_backward",
    "rms_norm_train_forward",
    "swiglu_backward",
    "swiglu_forward",
]

_F = TypeVar("_F", bound=Callable[..., Any])


def check_compiler() -> None:
    """Refuse ``--fused-kernels`` (one line, before any work) where the C++ compiler Inductor's CPU
    kernels need (``$CXX``, else ``g++``) is not on the PATH. Not on a CUDA host (Triton builds
    the GPU kernels; a CPU run there that cannot compile still stops with the flag named)."""
    compiler = os.environ.get("CXX") or "g++"
    if not torch.cuda.is_available() and shutil.which(compiler) is None:
        raise UserError(f"--fused-kernels: no C++ compiler {compiler!r} on the PATH (torch.compile needs one "
                        "for CPU kernels; set CXX or run without --fused-kernels)")  # fmt: skip


def _compiled(fn: _F) -> _F:
    """``fn`` compiled on its first call (one graph; static shapes, then dynamic after a change);
    a compiler failure becomes one line naming ``--fused-kernels``."""
    compiled: list[Callable[..., Any]] = []

    def call(*args: Any) -> Any:
        if not compiled:
            import torch._inductor.config as inductor

            # compile in this process: a pool of compile workers would import torch in the
            # background (seconds of CPU each) while the first steps run, in every rank
            inductor.compile_threads = 1
            compiled.append(torch.compile(fn, fullgraph=True))
        try:
            return compiled[0](*args)
        except Exception as exc:  # Inductor raises many types; all mean "no fused kernel here"
            if type(exc).__module__.startswith("torch._"):
                raise UserError(f"--fused-kernels: torch.compile could not build {fn.__name__}: "
                                f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
                                " (run without --fused-kernels)") from exc  # fmt: skip
            raise

    call.__name__ = call.__qualname__ = fn.__name__
    call.__doc__ = fn.__doc__
    return call  # type: ignore[return-value]


# --- RMSNorm with a frozen weight (pretrain.models.norms._FrozenRMSNorm) ------------------------


@_compiled
def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight * (x * rstd), rstd)`` for ``x [..., h]``, ``rstd = rsqrt(mean(x^2) + eps) [..., 1]``."""
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x * rstd * weight, rstd


@_compiled
def rms_norm_backward(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> torch.Tensor:
    """The input gradient ``r (w g) - x r^3 mean(w g x)`` ``[..., h]``."""
    gw = grad * weight
    coef = (gw * x).sum(-1, keepdim=True) * rstd.pow(3) / x.shape[-1]
    return gw * rstd - x * coef


# --- RMSNorm with a trained weight (pretrain.models.norms._TrainedRMSNorm) ----------------------


@_compiled
def rms_norm_train_forward(
    x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight * normed, rstd)`` for ``x [..., h]`` of any float dtype: ``normed = (x r)`` cast to
    ``x``'s dtype, ``r = rsqrt(mean(x^2) + eps) [..., 1]`` in float32 (:class:`RMSNorm`'s plain path)."""
    h = x.float()
    rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (h * rstd).to(x.dtype), rstd


@_compiled
def rms_norm_train_backward(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d x [..., h], d weight [h])``: ``d weight = sum over rows of grad * normed``, ``d x = r gw -
    x r^3 mean(gw x)`` with ``gw = grad * weight`` in float32."""
    h = x.float()
    normed = (h * rstd).to(x.dtype)
    grad_weight = (grad.float() * normed.float()).reshape(-1, x.shape[-1]).sum(0)
    gw = (grad * weight).float()
    coef = (gw * h).sum(-1, keepdim=True) * rstd.pow(3) / x.shape[-1]
    return (gw * rstd - h * coef).to(x.dtype), grad_weight.to(weight.dtype)


# --- SwiGLU (pretrain.models.swiglu._SwiGLU) ------------------------------------------------------


@_compiled
def swiglu_forward(y: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` ``[..., f]`` for ``y = [gate, up]`` ``[..., 2 f]``."""
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


@_compiled
def swiglu_backward(grad: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``[d gate, d up]`` ``[..., 2 f]`` for the output gradient ``grad [..., f]``:
    ``d up = silu(gate) grad``, ``d gate = grad up sigmoid(gate) (1 + gate (1 - sigmoid(gate)))``
    (``silu_backward``'s formula)."""
    gate, up = y.chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    grad_gate = grad * up * (sig * (1 + gate * (1 - sig)))
    return torch.cat([grad_gate, gate * sig * grad], dim=-1)
