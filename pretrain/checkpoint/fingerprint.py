"""A fingerprint of a model's weights: the same weights give the same string in every layout and format.

The fingerprint identifies *weights*, not files: a tp2/pp2 checkpoint, its tp1 reshard, a
``torch_dist`` copy and its Hugging Face export all hash the same canonical full tensors, so the
leaderboard shows them as one model. What is hashed, per canonical tensor name (sorted):

* the canonical full tensor (all TP shards joined, pipeline stages merged, upstream QKV orders
  converted: exactly what a :class:`~pretrain.checkpoint.types.TensorSource` yields);
* vocabulary tensors cut to the true vocabulary (``vocab_size`` rows): padding rows are a layout
  detail (``make_vocab_size_divisible_by`` x TP) and never enter the hash;
* floating-point values as float32 numbers (fp16 and bf16 widen exactly, so a half-precision
  checkpoint and its float32 export agree; weights *rounded* to bf16 differ from the float32
  originals, as they should); integer tensors as little-endian int64;
* heads initialised on import because the source had none (``ModelSpec.fresh_heads``, e.g. the
  LM head of a bare HF ``BertModel``) are left out: they are not the source's weights.

Each tensor is digested on its own (a hash of name, shape and values, read in chunks), and the
fingerprint is the ``sha256`` of the scheme and the sorted (name, digest) pairs, so tensors may
arrive in any order and only one is in memory at a time. The result reads ``w2:`` + 64 hex digits;
the scheme names the rule, so a later change of rule can never be mistaken for different weights:

* ``w2`` (written now): each tensor's values are hashed with BLAKE3 in their *narrowest exact*
  form: bf16 bit patterns (little-endian uint16) when every float32 value's low 16 bits are zero,
  which is exactly when it is a bf16 number, else float32. A bf16 checkpoint is hashed where its
  bytes lie (no widening, no copy), and the same numbers stored as float32 give the same bytes.
  About 10x faster than ``w1`` on a CPU without SHA extensions (4.5 GB/s against 0.2 GB/s of bf16
  source per core), which made the fingerprint most of a conversion's time.
* ``w1`` (written before): every float tensor widened to float32 and hashed with ``sha256``.
  Still computed where a recorded ``w1`` value is checked (a LoRA adapter's base).
"""

from __future__ import annotations

import hashlib
import os
import struct
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol

import blake3
import numpy as np
import torch

from pretrain.checkpoint.types import ColumnPieces, ColumnPieceSource, RowPieces, RowPieceSource, TensorSource
from pretrain.checkpoint.work_split import SINGLE, WorkSplit
from pretrain.models.sharding import is_vocab_tensor
from pretrain.utils.buffer_pool import read_only_views
from pretrain.utils.errors import UserError
from pretrain.utils.gathered_write import column_chunks

if TYPE_CHECKING:
    from pretrain.models.families.converter import HFConfig

SCHEME = "w2"  # what new fingerprints are computed with
SCHEMES = ("w1", "w2")  # every scheme a fingerprint may carry (and be recomputed in)
SHORT_HEX = 12
_CHUNK_ELEMENTS = 1 << 22  # 16 MiB of float32 per hashing step
_BF16_BLOCK = 1 << 25  # bf16 elements per BLAKE3 update (64 MiB, read where they lie)


Digestible = torch.Tensor | RowPieces | ColumnPieces  # a full tensor, whole or as its stored blocks


def tensor_digest(name: str, tensor: Digestible, *, scheme: str = SCHEME) -> bytes:
    """The digest of ``name``, the shape and the values under ``scheme`` (module docstring); no
    copy of the whole tensor is made of a contiguous tensor (it is read in chunks), nor of
    :class:`~pretrain.checkpoint.types.RowPieces` (read piece by piece: the same digest as the
    joined tensor, since each hash only sees the values' stream), nor of
    :class:`~pretrain.checkpoint.types.ColumnPieces` under ``w2`` (each row's blocks in turn,
    short rows joined a few MB at a time in one reused buffer: :func:`_column_digest`)."""
    if tensor.dtype.is_complex:
        raise UserError(f"tensor {name}: complex weights cannot be fingerprinted")
    if isinstance(tensor, ColumnPieces):
        if scheme == "w2" and sys.byteorder == "little":
            return _column_digest(name, tensor)
        tensor = torch.cat(tensor.parts, dim=1)  # w1 (or a big-endian host): the plain path
    pieces = tensor.parts if isinstance(tensor, RowPieces) else (tensor,)
    flats = [p.detach().reshape(-1) for p in pieces]
    if scheme == "w1":
        return _digest_w1(name, tensor.shape, flats)
    if scheme != "w2":
        raise ValueError(f"unknown fingerprint scheme {scheme!r}")
    return _digest_w2(name, tensor.shape, tensor.dtype, lambda: flats)


def _digest_w2(
    name: str, shape: torch.Size, dtype: torch.dtype, flats: Callable[[], Iterable[torch.Tensor]]
) -> bytes:
    """``w2`` of the values ``flats()`` yields (1-D, in row-major order; called once more for
    floats that are not bf16: whether every value is a bf16 number, then the hash)."""
    h = blake3.blake3()
    if not dtype.is_floating_point:
        kind, update = "i", _update_int64
    elif dtype == torch.bfloat16 or not any(_has_low_bits(f) for f in flats()):
        kind, update = "b", _update_bf16  # every value is a bf16 number: its 16 bits
    else:
        kind, update = "f", _update_float32
    _header(h, name, kind, shape)
    for flat in flats():
        update(h, flat)
    return h.digest()


class _Hasher(Protocol):  # the part of hashlib's / blake3's hash objects used here
    def update(self, data: bytes | memoryview, /) -> object: ...


def _column_digest(name: str, pieces: ColumnPieces) -> bytes:
    """``w2`` of ``pieces`` from the joined tensor's values in row-major order, a chunk at a time
    (:func:`~pretrain.utils.gathered_write.column_chunks`: each row's blocks where they lie, or
    short rows staged): the stream the joined tensor gives, without the join. Little-endian hosts
    only (the chunks are native bytes)."""

    def flats() -> Iterator[torch.Tensor]:
        for chunk in column_chunks(pieces.parts):
            if len(chunk):
                yield torch.frombuffer(chunk, dtype=pieces.dtype)

    return _digest_w2(name, pieces.shape, pieces.dtype, flats)


def _header(h: _Hasher, name: str, kind: str, shape: torch.Size) -> None:
    h.update(struct.pack("<I", len(name.encode())) + name.encode())
    h.update(kind.encode() + struct.pack("<I", len(shape)) + struct.pack(f"<{len(shape)}q", *shape))


def _le_bytes(t: torch.Tensor, np_type: str) -> memoryview:
    """The bytes of a contiguous CPU tensor in little-endian ``np_type`` (no copy on such hosts)."""
    return np.ascontiguousarray(t.numpy(), dtype=np_type).data.cast("B")


def _has_low_bits(flat: torch.Tensor) -> bool:
    """Whether some value of a 1-D float tensor, as float32, has a non-zero low half (is not a
    bf16 number). fp32 is checked where it lies; other dtypes are widened a chunk at a time."""
    buf = None if flat.dtype == torch.float32 else torch.empty(min(flat.numel(), _CHUNK_ELEMENTS))
    for start in range(0, flat.numel(), _CHUNK_ELEMENTS):
        chunk = flat[start : start + _CHUNK_ELEMENTS]
        if buf is not None:
            chunk = buf[: chunk.numel()].copy_(chunk)
        if bool((chunk.view(torch.int32) & 0xFFFF).any()):
            return True
    return False


def _update_bf16(h: _Hasher, flat: torch.Tensor) -> None:
    """Hash a 1-D float tensor whose values are all bf16 numbers as bf16 bit patterns."""
    if flat.dtype == torch.bfloat16:  # where the bytes lie: a mapped checkpoint is never copied
        for start in range(0, flat.numel(), _BF16_BLOCK):
            h.update(_le_bytes(flat[start : start + _BF16_BLOCK].view(torch.int16), "<i2"))
        return
    buf = torch.empty(min(flat.numel(), _CHUNK_ELEMENTS), dtype=torch.bfloat16)
    for start in range(0, flat.numel(), _CHUNK_ELEMENTS):
        chunk = flat[start : start + _CHUNK_ELEMENTS]
        part = buf[: chunk.numel()]
        part.copy_(chunk)  # exact: the values are bf16 numbers (float32 -> bf16 drops zero bits)
        h.update(_le_bytes(part.view(torch.int16), "<i2"))


def _update_float32(h: _Hasher, flat: torch.Tensor) -> None:
    _update_widened(h, flat, torch.float32, "<f4")


def _update_int64(h: _Hasher, flat: torch.Tensor) -> None:
    _update_widened(h, flat, torch.int64, "<i8")


def _update_widened(h: _Hasher, flat: torch.Tensor, target: torch.dtype, np_type: str) -> None:
    """Hash ``flat`` as ``target`` values: where they lie when already so, else a chunk at a time
    through one buffer (a fresh 64 MiB allocation per chunk costs its page faults)."""
    if flat.dtype == target:
        h.update(_le_bytes(flat, np_type))
        return
    buf = torch.empty(min(flat.numel(), _CHUNK_ELEMENTS), dtype=target)
    for start in range(0, flat.numel(), _CHUNK_ELEMENTS):
        chunk = flat[start : start + _CHUNK_ELEMENTS]
        part = buf[: chunk.numel()]
        part.copy_(chunk)
        h.update(_le_bytes(part, np_type))


def _digest_w1(name: str, shape: torch.Size, flats: list[torch.Tensor]) -> bytes:
    """``w1``: ``sha256`` of ``name``, the shape and the values widened to float32 (int64)."""
    h = hashlib.sha256()
    kind = "f" if flats[0].is_floating_point() else "i"
    _header(h, name, kind, shape)
    target, np_type = (torch.float32, "<f4") if kind == "f" else (torch.int64, "<i8")
    buf = torch.empty(
        min(max(f.numel() for f in flats), _CHUNK_ELEMENTS), dtype=target
    )  # always copied, as w1 was
    for flat in flats:
        for start in range(0, flat.numel(), _CHUNK_ELEMENTS):
            chunk = flat[start : start + _CHUNK_ELEMENTS]
            part = buf[: chunk.numel()]
            part.copy_(chunk)
            h.update(_le_bytes(part, np_type))
    return h.digest()


def fingerprint_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    vocab_size: int | None = None,
    skip_prefixes: tuple[str, ...] = (),
    scheme: str = SCHEME,
) -> str:
    """The fingerprint of ``(canonical name, full tensor)`` pairs, in any order, one at a time.

    ``vocab_size``: rows kept of vocabulary tensors (``None``: as given). ``skip_prefixes``: names
    starting with one of these (followed by ``.``) are left out. ``scheme``: :data:`SCHEMES`."""
    digests = tensor_digests(tensors, vocab_size=vocab_size, skip_prefixes=skip_prefixes, scheme=scheme)
    return combine_digests(digests, scheme=scheme)


def tensor_digests(
    tensors: Iterable[tuple[str, Digestible]],
    *,
    vocab_size: int | None = None,
    skip_prefixes: tuple[str, ...] = (),
    workers: int | None = None,
    scheme: str = SCHEME,
) -> dict[str, bytes]:
    """Each tensor's :func:`tensor_digest` by name (see :func:`fingerprint_tensors`): processes that
    each read part of a model (expert-parallel ranks) combine theirs with :func:`combine_digests`.

    Digests run on ``workers`` threads (default :func:`digest_workers`): the hashes and the float32
    widening release the GIL, so they overlap each other and the reading of the next tensor. At
    most ``workers`` tensors are held at once (the one being read included), so memory stays
    within ``workers`` x the largest tensor plus one 64 MiB buffer per thread."""
    n = digest_workers() if workers is None else max(1, workers)
    digests: dict[str, bytes] = {}
    seen: set[str] = set()
    slots = threading.BoundedSemaphore(n)
    pending: list[tuple[str, Future[bytes]]] = []

    def digest(name: str, tensor: Digestible) -> bytes:
        try:
            return tensor_digest(name, tensor, scheme=scheme)
        finally:  # a digest that raised gives its pages back too
            if isinstance(tensor, (RowPieces, ColumnPieces)) and tensor.release is not None:
                tensor.release()
            slots.release()  # the tensor is dropped with this frame: the next one may be read

    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="fingerprint") as pool:
        try:
            for name, tensor in _kept(tensors, vocab_size=vocab_size, skip_prefixes=skip_prefixes, seen=seen,
                                      slots=slots):  # fmt: skip
                pending.append((name, pool.submit(digest, name, tensor)))
                del tensor
            for name, future in pending:
                digests[name] = future.result()
        finally:
            for _, future in pending:
                future.cancel()
    return digests


def _kept(
    tensors: Iterable[tuple[str, Digestible]],
    *,
    vocab_size: int | None,
    skip_prefixes: tuple[str, ...],
    seen: set[str],
    slots: threading.BoundedSemaphore,
) -> Iterator[tuple[str, Digestible]]:
    """The ``(name, tensor)`` pairs to digest (skipped prefixes left out, vocabulary rows cut); a
    slot is taken before each tensor is read, so a reader never runs ahead of the digests."""
    it = iter(tensors)
    while True:
        slots.acquire()
        try:
            name, tensor = next(it)
        except StopIteration:
            slots.release()
            return
        except BaseException:
            slots.release()
            raise
        if any(name.startswith(p + ".") for p in skip_prefixes):
            slots.release()
            continue
        try:
            if name in seen:
                raise UserError(f"tensor {name}: given twice to the weights fingerprint")
            seen.add(name)
            if vocab_size is not None and is_vocab_tensor(name):
                if tensor.shape[0] < vocab_size:
                    raise UserError(
                        f"tensor {name}: {tensor.shape[0]} vocabulary rows, fewer than {vocab_size}"
                    )
                if isinstance(tensor, ColumnPieces):  # (no source gives vocabulary rows so)
                    tensor = torch.cat(tensor.parts, dim=1)
                tensor = tensor[:vocab_size]
        except BaseException:
            slots.release()
            raise
        yield name, tensor
        del tensor  # held by a digest thread now; not kept here while the next slot is awaited


def digest_workers() -> int:
    """Threads for :func:`tensor_digests`: ``MLM_FINGERPRINT_THREADS`` or the usable cores (at most 4:
    past that the reader, not the hashing, is the limit)."""
    env = os.environ.get("MLM_FINGERPRINT_THREADS")
    if env:
        try:
            return max(1, int(env))
        except ValueError:
            raise UserError(f"MLM_FINGERPRINT_THREADS={env!r} is not a whole number") from None
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(4, cores))


def combine_digests(digests: Mapping[str, bytes], *, scheme: str = SCHEME) -> str:
    """The fingerprint of every tensor's ``scheme`` digest (``sha256`` of the scheme and the
    name-sorted pairs)."""
    if not digests:
        raise UserError("the weights fingerprint needs at least one tensor")
    total = hashlib.sha256(scheme.encode())
    for name in sorted(digests):
        total.update(struct.pack("<I", len(name.encode())) + name.encode() + digests[name])
    return f"{scheme}:{total.hexdigest()}"


def weights_fingerprint(
    source: TensorSource | Mapping[str, torch.Tensor], *, vocab_size: int | None = None,
    split: WorkSplit = SINGLE, stop: threading.Event | None = None, workers: int | None = None,
    scheme: str = SCHEME,
) -> str:  # fmt: skip
    """The fingerprint of a canonical source (``names()``/``tensor(name)``/``spec``: a checkpoint
    reader, ``DictSource``, ``import_hf``) or of a ``{canonical name: full tensor}`` mapping.

    A source's true vocabulary (``spec.cfg.vocab_size``) and fresh heads (``spec.fresh_heads``) are
    used unless ``vocab_size`` is given; tensors are read one at a time. ``split`` (torchrun): each
    process digests its share of the tensors and the digests are gathered (collective). ``stop``:
    when set, reading ends with ``UserError`` (a background fingerprint whose conversion failed).
    ``workers``: digest threads (:func:`tensor_digests`). ``scheme``: :data:`SCHEMES` (the scheme
    of a recorded value to check: :func:`scheme_of`)."""
    if isinstance(source, Mapping):
        return fingerprint_tensors(source.items(), vocab_size=vocab_size, scheme=scheme)
    spec = getattr(source, "spec", None)
    cfg = getattr(spec, "cfg", None)
    vocab = vocab_size if vocab_size is not None else getattr(cfg, "vocab_size", None)
    fresh = tuple(getattr(spec, "fresh_heads", ()) or ())
    names = list(source.names())
    if split.parallel:
        from pretrain.checkpoint.tensor_meta import tensor_meta

        metas = [tensor_meta(source, n) for n in names]
        mine = split.mine([m.numel() * m.dtype.itemsize for m in metas])
        names = [n for n, keep in zip(names, mine, strict=True) if keep]
    with read_only_views():  # hashed where the bytes lie: no copy of a tensor only read
        digests = tensor_digests(
            ((n, _digestible(source, n)) for n in _until(names, stop)),
            vocab_size=vocab,
            skip_prefixes=fresh,
            workers=workers,
            scheme=scheme,
        )
    if split.parallel:
        digests = {k: v for part in split.gather(digests) for k, v in part.items()}
    return combine_digests(digests, scheme=scheme)


def _digestible(source: TensorSource, name: str) -> Digestible:
    """``source.tensor(name)``, or its rows or columns in blocks where the source gives them (a
    legacy checkpoint's column-parallel and row-parallel shards: hashed where they lie, never
    joined)."""
    rows = source.row_pieces(name) if isinstance(source, RowPieceSource) else None
    if rows is not None:
        return rows
    columns = source.column_pieces(name) if isinstance(source, ColumnPieceSource) else None
    return columns if columns is not None else source.tensor(name)


def _until(names: Iterable[str], stop: threading.Event | None) -> Iterator[str]:
    for name in names:
        if stop is not None and stop.is_set():
            raise UserError("the weights fingerprint was cancelled")
        yield name


def short_fingerprint(fingerprint: str) -> str:
    """The first :data:`SHORT_HEX` hex digits, for display (``w2:3fa9c2d07b1e``)."""
    scheme, _, digest = fingerprint.partition(":")
    return f"{scheme}:{digest[:SHORT_HEX]}" if digest else fingerprint[:SHORT_HEX]


def is_fingerprint(value: object) -> bool:
    """Whether ``value`` is a fingerprint string of a known scheme (``w2:`` + 64 hex digits)."""
    if not isinstance(value, str):
        return False
    scheme, sep, digest = value.partition(":")
    return (
        bool(sep) and scheme in SCHEMES and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)
    )


def scheme_of(fingerprint: str) -> str:
    """The scheme a fingerprint string was computed with (``ValueError`` for a string that is none)."""
    if not is_fingerprint(fingerprint):
        raise ValueError(f"{fingerprint!r} is not a weights fingerprint")
    return fingerprint.partition(":")[0]


def hf_weights_fingerprint(state: Mapping[str, torch.Tensor], hf_config: HFConfig) -> str:
    """The fingerprint of a loaded Hugging Face model's ``state_dict()``.

    GPT-2 and the Llama-style families we convert are mapped to canonical names first (so an HF
    export of our checkpoint matches the checkpoint); any other architecture is hashed under its
    own names (stable, but not comparable with a Megatron-layout checkpoint)."""
    from pretrain.models.families import family_of_model_type
    from pretrain.models.kinds import kind_of

    family = family_of_model_type(getattr(hf_config, "model_type", None))
    # a causal-LM family holds all its tensors in HF; an HF BERT may lack the heads we would add
    if family is not None and kind_of(family.kind).causal_lm:
        try:
            imported = family.module().import_hf(state, hf_config, family)
            tensors = ((name, make()) for name, make in imported.makers.items())
            return fingerprint_tensors(tensors, vocab_size=imported.cfg.vocab_size)
        except UserError:
            pass  # e.g. an untied GPT-2 LM head: not one of our models, hash it as it is
    return fingerprint_tensors(state.items())
