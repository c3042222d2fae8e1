"""Dry runs of tensor code on dtypes and shapes alone (no data read, no memory).

Conversions announce every tensor before its bytes (a safetensors header, a rank file's pickle),
so they run the family's mappings once on shapes first. torch's ``FakeTensorMode`` does that, but
making one imports ``torch._dynamo``: about 2 s of a conversion's start-up on a 2-core host, as
much as the whole write of a 1B model. :class:`ShapeProbeMode` is the part of it conversions use:

* every op runs on ``meta`` tensors (what it makes: dtype, shape, strides; never data);
* a :class:`ShapeProbe` stands for a real tensor: it reports the device it stands on (``cpu``)
  and holds a ``meta`` tensor inside; factories (``torch.empty``...) under the mode make probes;
* a plain ``meta`` tensor given in is a *placeholder* (a tensor of another layer): an op that
  reads one makes a plain ``meta`` tensor, so what comes out as a probe was made from the probes
  and real constants alone (the rule :mod:`tools.hf_plan` sorts a mapping's outputs by);
* real (non-meta) tensors given in are read as their ``meta`` likeness: a memory-mapped file's
  tensor is never touched;
* an op that needs values (``.item()``, ``torch.equal``) raises, as it does on ``meta``: callers
  fall back to reading the data.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

_FACTORY_DEVICE = "device"


class ShapeProbe(torch.Tensor):
    """A tensor of a dtype and shape on ``device``, with no data: ``twin`` is its ``meta`` likeness."""

    twin: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor, device: torch.device) -> ShapeProbe:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined,no-any-return]
            cls, inner.shape, strides=inner.stride(), storage_offset=inner.storage_offset(),
            dtype=inner.dtype, device=device, requires_grad=False,
        )  # fmt: skip

    def __init__(self, inner: torch.Tensor, device: torch.device) -> None:
        self.twin = inner

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        raise RuntimeError(f"{func}: a shape probe was used outside its ShapeProbeMode")

    def __repr__(self, *, tensor_contents: Any = None) -> Any:  # type: ignore[override]  # the default reads data
        return f"ShapeProbe({tuple(self.shape)}, dtype={self.dtype}, device={self.device})"


class ShapeProbeMode(TorchDispatchMode):
    """Run every op on ``meta`` (module docstring); probes out where no placeholder went in."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in torch._dynamo.disable unless told not to, and
        # that imports torch._dynamo on the first op; nothing here is ever compiled
        return False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        leaves, _ = tree_flatten((args, kwargs))
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        placeholder = any(t.device.type == "meta" and not isinstance(t, ShapeProbe) for t in tensors)
        probes = [t for t in tensors if isinstance(t, ShapeProbe)]
        device = probes[0].device if probes else _factory_device(kwargs, tensors)
        if any(a.name == _FACTORY_DEVICE for a in func._schema.arguments):  # factories, .to(): never real
            kwargs[_FACTORY_DEVICE] = torch.device("meta")
        rule = _SHAPE_RULES.get(func)
        meta_args, meta_kwargs = tree_map(_as_meta, args), tree_map(_as_meta, kwargs)
        out = rule(*meta_args, **meta_kwargs) if rule is not None else func(*meta_args, **meta_kwargs)
        if placeholder:
            return out
        return tree_map(lambda t: ShapeProbe(t, device) if isinstance(t, torch.Tensor) else t, out)


def _joined(tensors: list[torch.Tensor], dim: int, *, new_dim: bool) -> torch.Tensor:
    """``cat`` (``new_dim=False``) or ``stack`` of ``meta`` tensors, from their shapes: torch's
    ``meta`` kernel of ``cat`` is Python wrapped in ``torch._dynamo.disable`` (the import)."""
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    if new_dim:
        shapes = {tuple(t.shape) for t in tensors}
        if len(shapes) != 1:
            raise RuntimeError(f"stack expects each tensor to be equal size, got {sorted(shapes)}")
        shape = list(tensors[0].shape)
        shape.insert(dim % (len(shape) + 1), len(tensors))
        return torch.empty(shape, dtype=dtype, device="meta")
    shaped = [t for t in tensors if t.dim() != 1 or t.shape[0] != 0]  # cat skips legacy empty 1-D
    if not shaped:
        return torch.empty(0, dtype=dtype, device="meta")
    d = dim % shaped[0].dim()
    rest = {tuple(t.shape[:d]) + tuple(t.shape[d + 1 :]) for t in shaped}
    if len(rest) != 1 or len({t.dim() for t in shaped}) != 1:
        raise RuntimeError(f"cat: sizes of tensors must match except in dimension {d}")
    shape = list(shaped[0].shape)
    shape[d] = sum(t.shape[d] for t in shaped)
    return torch.empty(shape, dtype=dtype, device="meta")


_SHAPE_RULES: dict[Any, Callable[..., torch.Tensor]] = {
    torch.ops.aten.cat.default: lambda tensors, dim=0: _joined(list(tensors), dim, new_dim=False),
    torch.ops.aten.stack.default: lambda tensors, dim=0: _joined(list(tensors), dim, new_dim=True),
}


def _as_meta(x: object) -> object:
    if isinstance(x, ShapeProbe):
        return x.twin
    if isinstance(x, torch.Tensor) and x.device.type != "meta":
        return x.to("meta")  # its dtype, shape and strides; the data stays where it is
    return x


def _factory_device(kwargs: dict[str, Any], tensors: list[torch.Tensor]) -> torch.device:
    """The device a probe made by an op without probe inputs stands on: the factory's ``device``,
    else a real input's, else the CPU."""
    device = kwargs.get(_FACTORY_DEVICE)
    if device is not None:
        return torch.device(device)
    real = [t.device for t in tensors if t.device.type != "meta"]
    return real[0] if real else torch.device("cpu")


def has_values(t: torch.Tensor) -> bool:
    """Whether ``t`` holds values: not a ``meta`` placeholder, not a :class:`ShapeProbe` (a check
    of values skips both; on a probe it would only fail the dry run)."""
    return t.device.type != "meta" and not isinstance(t, ShapeProbe)


def shape_of(make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """The ``meta`` likeness of what ``make()`` returns, run under :class:`ShapeProbeMode`
    (raises where ``make`` needs values)."""
    with ShapeProbeMode():
        made = make()
    return torch.empty(made.shape, dtype=made.dtype, device="meta")
