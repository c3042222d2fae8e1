"""Load upstream Megatron-LM checkpoint files without trusting their pickles.

Upstream pickles an ``argparse.Namespace`` in ``args`` (and sometimes megatron enums or
Transformer-Engine ``io.BytesIO`` extra states), so ``torch.load(weights_only=True)`` refuses
the files and ``weights_only=False`` would run whatever the pickle names. :func:`load_untrusted`
uses ``torch.load`` with a restricted ``pickle_module``:

* allowed: tensor and parameter rebuild functions, storages, ``OrderedDict``, torch dtypes,
  ``torch.device``, ``torch.Size``, numpy arrays/dtypes/scalars (RNG states), plain containers;
* ``argparse.Namespace`` becomes a plain ``dict``;
* harmless value types real Megatron-LM ``args`` carry load as values: ``signal.Signals``
  (``exit_signal``, core_v0.16+), torch dtypes (``params_dtype``, ``main_grads_dtype``, ...),
  and Megatron's enums (:data:`MEGATRON_ENUMS`: ``AttnBackend``, ``ModelType``, ``AttnMaskType``,
  ... in every module path they had) as inert :class:`Placeholder` objects naming their member;
* any other *class* (a CamelCase name outside the dangerous modules, e.g.
  ``megatron.core.enums.ModelType``) becomes an inert :class:`Placeholder` that only records its
  name and arguments;
* everything else (``os.system``, ``builtins.eval``, ``subprocess.Popen``, any function) is
  refused with :class:`UnsafePickleError` before it can run.

:func:`load_dcp_metadata` reads a ``torch_dist`` ``.metadata`` file (torch's own reader calls plain
``pickle.load``) with a stricter list: exactly the ``torch.distributed.checkpoint`` metadata
classes (:data:`DCP_METADATA_GLOBALS`), torch dtypes and ``torch.Size``; no placeholders.
"""

from __future__ import annotations

import collections
import io
import pickle
import signal
import types
import zipfile
from pathlib import Path
from typing import IO, Any

import torch

from pretrain.utils.errors import UserError

# (module, name) pairs returned as the real object.
_ALLOWED: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch._utils", "_rebuild_tensor"): torch._utils._rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
    ("torch._utils", "_rebuild_parameter"): torch._utils._rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): torch._utils._rebuild_parameter_with_state,
    ("torch._tensor", "_rebuild_from_type_v2"): torch._tensor._rebuild_from_type_v2,
    ("torch", "Size"): torch.Size,
    ("torch", "device"): torch.device,
    ("torch", "Tensor"): torch.Tensor,
    ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "complex"): complex,
    ("builtins", "slice"): slice,
    ("builtins", "bytearray"): bytearray,
    ("__builtin__", "set"): set,
}
# numpy pickles its bytes with ``_codecs.encode(str, "latin1")`` under protocol 2.
_ALLOWED_CODECS = {("_codecs", "encode"), ("codecs", "encode")}
_NUMPY_MODULES = ("numpy", "numpy.core.multiarray", "numpy._core.multiarray", "numpy.dtypes")
_NUMPY_NAMES = {"ndarray", "dtype", "_reconstruct", "scalar"}
# Modules whose members can run code, touch files or import: refused outright, even classes.
_DANGEROUS_ROOTS = {
    "builtins", "__builtin__", "os", "posix", "nt", "subprocess", "sys", "importlib", "pickle",
    "_pickle", "marshal", "shutil", "socket", "runpy", "types", "code", "codeop", "ctypes", "pty",
    "webbrowser", "functools", "operator", "platform", "multiprocessing", "threading", "asyncio",
    "pdb", "timeit", "tempfile", "pathlib", "io", "_io", "torch", "numpy", "copyreg", "inspect",
    "signal", "glob", "zipimport", "pkgutil", "cProfile", "profile", "trace", "dill", "cloudpickle",
}  # fmt: skip
_INERT_CLASSES = {("io", "BytesIO"), ("_io", "BytesIO")}  # Transformer Engine ``_extra_state``
# Enums found in Megatron-LM's ``args`` across releases (arguments.py and the pretrain scripts):
# attention_backend (core_v0.10+), model_type (set by pretrain(); megatron.model.enums in v2-v3,
# megatron.core.enums since core_r0.x), attn_mask_type / position_embedding_type of older code.
MEGATRON_ENUMS = {
    ("megatron.core.transformer.enums", "AttnBackend"),
    ("megatron.core.transformer.enums", "AttnMaskType"),
    ("megatron.core.transformer.enums", "AttnType"),
    ("megatron.core.transformer.enums", "ModelType"),
    ("megatron.core.enums", "ModelType"),
    ("megatron.core.models.common.embeddings.rope_utils", "RopeType"),
    ("megatron.model.enums", "ModelType"),
    ("megatron.model.enums", "AttnMaskType"),
    ("megatron.model.enums", "AttnType"),
    ("megatron.model.enums", "LayerType"),
    ("megatron.model.enums", "PositionEmbeddingType"),
    ("megatron.legacy.model.enums", "AttnMaskType"),
    ("megatron.legacy.model.enums", "AttnType"),
    ("megatron.legacy.model.enums", "LayerType"),
}
_VALUE_CLASSES: dict[tuple[str, str], Any] = {("signal", "Signals"): signal.Signals}  # enum lookups only


class UnsafePickleError(pickle.UnpicklingError):
    """The pickle names a global that is not on the allow-list."""


class Placeholder:
    """An inert stand-in for a class we do not import (e.g. a megatron enum member)."""

    qualname = "?"

    args: tuple[Any, ...]
    state: Any

    def __new__(cls, *args: Any, **kwargs: Any) -> Placeholder:  # pickle's NEWOBJ skips __init__
        obj = super().__new__(cls)
        obj.args, obj.state = args, None
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __reduce__(self) -> Any:  # never re-pickle as the foreign class
        return (str, (repr(self),))

    def __repr__(self) -> str:
        args = ", ".join(repr(a) for a in self.args)
        return f"<{self.qualname}({args})>"


class NamespaceDict(dict):  # type: ignore[type-arg]
    """What an ``argparse.Namespace`` unpickles into (later converted to a plain dict)."""

    def __setstate__(self, state: Any) -> None:
        self.update(state if isinstance(state, dict) else {})


def _placeholder(module: str, name: str) -> type[Placeholder]:
    return type(name, (Placeholder,), {"qualname": f"{module}.{name}"})


def _is_torch_dtype(module: str, name: str) -> bool:
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


def resolve_global(module: str, name: str) -> Any:
    """The object a pickle may reference as ``module.name`` (or raise :class:`UnsafePickleError`)."""
    if (module, name) in _ALLOWED:
        return _ALLOWED[(module, name)]
    if _is_torch_dtype(module, name):
        return getattr(torch, name)
    if (module, name) in _ALLOWED_CODECS:
        import codecs

        return codecs.encode
    if module in _NUMPY_MODULES and name in _NUMPY_NAMES:
        import importlib

        return getattr(importlib.import_module(module), name)
    if module.startswith("numpy") and name.endswith("DType"):  # numpy 2 dtype classes
        import numpy

        return getattr(numpy.dtypes, name, None) or _placeholder(module, name)
    if (module, name) == ("argparse", "Namespace"):
        return NamespaceDict
    if (module, name) in _VALUE_CLASSES:  # Signals(15) looks a member up, nothing else
        return _VALUE_CLASSES[(module, name)]
    if (module, name) in _INERT_CLASSES or (module, name) in MEGATRON_ENUMS:
        return _placeholder(module, name)
    root = module.split(".")[0]
    if root not in _DANGEROUS_ROOTS and name[:1].isupper() and name.isidentifier():
        return _placeholder(module, name)
    raise UnsafePickleError(f"refusing to unpickle global {module}.{name} (not on the allow-list)")


# What dcp ``Metadata`` pickles reference (torch 2.x and megatron-core's; ``_shard`` paths: torch <= 2.1). Each is a
# dataclass, an enum looked up by value, a path value or a name -> layout lookup: none runs code.
DCP_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata", "StorageMeta", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.planner", name)  # megatron-core keeps the save plans (all_local_plans)
    for name in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed._shard.sharded_tensor.metadata", "TensorProperties"),
    ("torch.distributed._shard.sharded_tensor.metadata", "MEM_FORMAT_ENCODING"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib._local", "PosixPath"),
    ("pathlib._local", "PurePosixPath"),
}  # fmt: skip


class _DcpMetadataUnpickler(pickle.Unpickler):
    """Resolves only :data:`DCP_METADATA_GLOBALS`, torch dtypes, ``torch.Size`` and ``OrderedDict``."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in DCP_METADATA_GLOBALS:
            import importlib

            return getattr(importlib.import_module(module), name)
        if _is_torch_dtype(module, name) or (module, name) in {
            ("torch", "Size"),
            ("collections", "OrderedDict"),
        }:
            return resolve_global(module, name)
        raise UnsafePickleError(f"refusing to unpickle global {module}.{name} (not on the allow-list)")


def load_dcp_metadata(path: Path, unpickler: type[pickle.Unpickler] | None = None) -> object:
    """The ``Metadata`` object a ``torch_dist`` ``.metadata`` file pickles, read without trusting it
    (``unpickler``: one resolving the same allow-list otherwise, e.g. to plain stand-in classes).

    A global off the list is one-line :class:`UserError` naming the file (nothing of the pickle runs);
    a truncated file too.
    """
    try:
        with open(path, "rb") as f:
            return (unpickler or _DcpMetadataUnpickler)(f).load()
    except UnsafePickleError as exc:
        raise UserError(f"{path}: unsafe checkpoint file: {exc}") from None
    except Exception as exc:
        raise UserError(
            f"{path}: cannot be read, truncated or corrupt? ({type(exc).__name__}: {exc})"
        ) from None


class Unpickler(pickle.Unpickler):
    """``pickle.Unpickler`` whose ``find_class`` only resolves allowed globals."""

    def find_class(self, module: str, name: str) -> Any:
        return resolve_global(module, name)


def load(file: IO[bytes], **kwargs: Any) -> Any:
    """``pickle.load`` with the restricted unpickler (used by torch for legacy files)."""
    return Unpickler(file, **kwargs).load()


def loads(data: bytes, **kwargs: Any) -> Any:
    import io

    return load(io.BytesIO(data), **kwargs)


def _pickle_module() -> types.ModuleType:
    """The ``pickle_module`` handed to ``torch.load``: restricted ``Unpickler``/``load``."""
    module = types.ModuleType("pretrain_restricted_pickle")
    module.Unpickler = Unpickler  # type: ignore[attr-defined]
    module.UnpicklingError = pickle.UnpicklingError  # type: ignore[attr-defined]
    module.load = load  # type: ignore[attr-defined]
    module.loads = loads  # type: ignore[attr-defined]
    return module


PICKLE_MODULE = _pickle_module()


def plain(value: Any) -> Any:
    """Namespaces -> dicts and placeholders -> strings, recursively (tensors kept as they are)."""
    if isinstance(value, dict):
        out = {k: plain(v) for k, v in value.items()}
        return out if type(value) in (dict, NamespaceDict) else type(value)(out)
    if isinstance(value, list | tuple) and not hasattr(value, "_fields"):
        return type(value)(plain(v) for v in value)
    if isinstance(value, Placeholder):
        return repr(value)
    return value


def load_untrusted(path: Path, *, mmap: bool = True) -> dict[str, Any]:
    """Load an upstream (or our) checkpoint file with the restricted unpickler.

    ``mmap`` applies to zip-format files (torch >= 1.6): tensors stay on disk until touched.
    Every failure is a one-line :class:`UserError` naming the file.
    """
    if not path.exists():
        raise UserError(f"missing checkpoint shard {path}")
    state = _torch_load(path, str(path), mmap=mmap and zipfile.is_zipfile(path))
    if not isinstance(state, dict):
        raise UserError(f"{path}: expected a dict at the top level, found {type(state).__name__}")
    return plain(state)


def load_untrusted_bytes(data: bytes, *, source: str) -> Any:
    """``torch.save``'d ``data`` (e.g. a ``torch_dist`` sharded object) through the restricted
    unpickler; failures are one line naming ``source``."""
    return plain(_torch_load(io.BytesIO(data), source, mmap=False))


def _torch_load(file: Path | IO[bytes], source: str, *, mmap: bool) -> Any:
    try:
        return torch.load(
            file, map_location="cpu", weights_only=False, pickle_module=PICKLE_MODULE, mmap=mmap
        )
    except UnsafePickleError as exc:
        raise UserError(f"{source}: unsafe checkpoint file: {exc}") from None
    except Exception as exc:  # truncated or foreign file: one clear line
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise UserError(
            f"{source}: cannot be read, truncated or corrupt? ({type(exc).__name__}: {first})"
        ) from None
