"""A ``torch_dist`` ``.metadata`` file read without importing ``torch.distributed.checkpoint``.

Importing dcp costs 0.6-1.2 s on a 2-core host (it pulls in ``torch.distributed.tensor`` and
sympy), as much as a whole 1B conversion's work. Reading a checkpoint needs only the values its
``.metadata`` pickles, so :func:`read_dcp_metadata` unpickles them into the plain classes here,
which carry the same attribute names as dcp's (``Metadata.state_dict_metadata``,
``TensorStorageMetadata.size`` / ``.chunks`` / ``.properties.dtype``, ``MetadataIndex(fqn,
offset)`` keys of ``storage_data`` with ``relative_path`` / ``offset`` / ``length`` /
``transform_descriptors``). The allow-list is :data:`~pretrain.checkpoint.safe_unpickle.DCP_METADATA_GLOBALS`,
as for the real classes: a name off it is refused before anything of the pickle runs.

Only the ``torch_dist`` readers use these; what still needs dcp itself (a stored item with storage
transforms) reads the file again with the real classes
(:func:`pretrain.checkpoint.safe_unpickle.load_dcp_metadata`).
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch

from pretrain.checkpoint.safe_unpickle import (
    DCP_METADATA_GLOBALS,
    UnsafePickleError,
    load_dcp_metadata,
    resolve_global,
)
from pretrain.utils.errors import UserError

__all__ = [
    "CONTIGUOUS",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "MemoryFormatCode",
    "Metadata",
    "MetadataIndex",
    "StorageInfo",
    "TensorProperties",
    "TensorStorageMetadata",
    "read_dcp_metadata",
]


class _Plain:
    """A pickled dataclass's fields as attributes (pickle sets ``__dict__`` from the state)."""

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.__dict__.items())})"


class ChunkStorageMetadata(_Plain):
    """One stored chunk: ``offsets`` and ``sizes`` (``torch.Size``) in global coordinates."""

    offsets: torch.Size
    sizes: torch.Size


class MemoryFormatCode:
    """A member of dcp's ``_MEM_FORMAT_ENCODING`` enum as written (0: ``TORCH_CONTIGUOUS_FORMAT``):
    pickled as an ``Enum`` member is, its class called with its value."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __reduce__(self) -> tuple[type[MemoryFormatCode], tuple[int]]:
        return (MemoryFormatCode, (self.value,))


CONTIGUOUS = MemoryFormatCode(0)  # one object, as the enum member is (a memo lookup after the first)


class TensorProperties(_Plain):
    """The stored tensor's ``dtype`` (dcp pickles a tuple; the deprecated fields are kept as read,
    and written at their defaults: strided, no grad, contiguous, not pinned)."""

    dtype: torch.dtype

    def __getstate__(self) -> tuple[object, ...]:
        return (self.dtype, torch.strided, False, CONTIGUOUS, False)

    def __setstate__(self, state: object) -> None:
        if isinstance(state, tuple):  # (dtype, layout, requires_grad, memory format code, pin_memory)
            self.dtype = state[0]
            self.__dict__.update(
                zip(("layout", "requires_grad", "memory_format", "pin_memory"), state[1:], strict=False)
            )
        elif isinstance(state, dict):
            self.__dict__.update(state)


class TensorStorageMetadata(_Plain):
    """A tensor's global ``size``, ``properties`` and the ``chunks`` the writer ranks stored."""

    properties: TensorProperties
    size: torch.Size
    chunks: list[ChunkStorageMetadata]


class BytesStorageMetadata(_Plain):
    """A stored object (``torch.save``d bytes), not a tensor."""


class StorageMeta(_Plain):
    """dcp's checkpoint ids (unused here)."""


class Metadata(_Plain):
    """``state_dict_metadata`` (key -> :class:`TensorStorageMetadata` / :class:`BytesStorageMetadata`)
    and ``storage_data`` (:class:`MetadataIndex` -> :class:`StorageInfo`)."""

    state_dict_metadata: dict[str, TensorStorageMetadata | BytesStorageMetadata]
    storage_data: dict[MetadataIndex, StorageInfo]
    storage_meta: StorageMeta | None = None
    planner_data: object = None
    version: str | None = None


class MetadataIndex:
    """The key of one stored item: ``fqn`` and the chunk's ``offset`` (equal and hashed on both, as
    dcp's frozen dataclass; ``index`` is only a hint)."""

    fqn: str
    offset: torch.Size | None = None
    index: int | None = None

    def __init__(self, fqn: str, offset: tuple[int, ...] | None = None, index: int | None = None) -> None:
        # as dcp's __init__ sets them (the pickled state's order): no offset attribute when None
        self.fqn, self.index = fqn, index
        if offset is not None:
            self.offset = torch.Size(offset)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update({"offset": None, "index": None, **state})

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, MetadataIndex) and (self.fqn, self.offset) == (other.fqn, other.offset)
        ) or NotImplemented

    def __hash__(self) -> int:
        return hash((self.fqn, self.offset))

    def __repr__(self) -> str:
        return f"MetadataIndex(fqn={self.fqn!r}, offset={self.offset!r})"


class StorageInfo(_Plain):
    """Where an item lies: ``relative_path`` (a ``.distcp`` file), ``offset``, ``length`` and the
    ``transform_descriptors`` (compression, ...) applied to its bytes, if any."""

    relative_path: str
    offset: int
    length: int
    transform_descriptors: tuple[str, ...] | None = None


class _Opaque(_Plain):
    """A megatron-core extra (the save plans in ``planner_data``, their enums): kept as read, never used."""

    def __init__(self, *args: object, **fields: object) -> None:
        super().__init__(**fields)
        self.args = args

    def __setstate__(self, state: object) -> None:
        if isinstance(state, dict):
            self.__dict__.update(state)


def _memory_format_code(value: object) -> object:
    """dcp's ``_MEM_FORMAT_ENCODING(value)``: the enum's value itself (the format is not used)."""
    return value


_STAND_INS: dict[str, object] = {
    "Metadata": Metadata, "StorageMeta": StorageMeta, "MetadataIndex": MetadataIndex,
    "TensorStorageMetadata": TensorStorageMetadata, "BytesStorageMetadata": BytesStorageMetadata,
    "ChunkStorageMetadata": ChunkStorageMetadata, "TensorProperties": TensorProperties,
    "_MEM_FORMAT_ENCODING": _memory_format_code, "MEM_FORMAT_ENCODING": _memory_format_code,
    "_StorageInfo": StorageInfo,
}  # fmt: skip


class _StandInUnpickler(pickle.Unpickler):
    """:data:`DCP_METADATA_GLOBALS` resolved to the classes above, torch dtypes, ``torch.Size``,
    ``OrderedDict`` and the layout lookup; any other global is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in DCP_METADATA_GLOBALS:
            if name in _STAND_INS:
                return _STAND_INS[name]
            if module.startswith("torch.distributed.checkpoint.planner"):
                return _Opaque
            if module == "torch.serialization":  # _get_layout: a name -> torch.layout lookup
                return getattr(torch.serialization, name)
            return _path_value
        if (module, name) in {("torch", "Size"), ("collections", "OrderedDict")} or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return resolve_global(module, name)
        raise UnsafePickleError(f"refusing to unpickle global {module}.{name} (not on the allow-list)")


def _path_value(*parts: str) -> str:
    """A pickled ``pathlib`` path (a ``checkpoint_id``), as its text."""
    return str(Path(*parts))


def read_dcp_metadata(it_dir: Path) -> Metadata:
    """``it_dir/.metadata`` as the plain classes above (one :class:`UserError` line for an unsafe,
    truncated or foreign file)."""
    path = it_dir / ".metadata"
    md = load_dcp_metadata(path, _StandInUnpickler)
    if not isinstance(md, Metadata):
        raise UserError(f"{path}: holds a {type(md).__name__}, not torch.distributed.checkpoint Metadata")
    md.__dict__.setdefault("storage_data", {})
    return md
