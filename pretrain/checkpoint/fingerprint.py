"""A fingerprint of a model's weights: the same weights give the same string in every layout and format.

The fingerprint identifies *weights*, not files: a tp2/pp2 checkpoint, its tp1 reshard, a
``torch_dist`` copy and its Hugging Face export all hash the same canonical full tensors, so the
leaderboard shows them as one model. What is hashed, per canonical tensor name (sorted):

* the canonical full tensor (all TP shards joined, pipeline stages merged, upstream QKV orders
  converted: exactly what a :class:`~pretrain.checkpoint.types.TensorSource` yields);
* vocabulary tensors cut to the true vocabulary (``vocab_size`` rows): padding rows are a layout
  detail (``make_vocab_size_divisible_by`` x TP) and never enter the hash;
* floating-point values normalised to little-endian float32 (fp16 and bf16 widen exactly, so a
  half-precision checkpoint and its float32 export agree; weights *rounded* to bf16 differ from the
  float32 originals, as they should); integer tensors as little-endian int64;
* heads initialised on import because the source had none (``ModelSpec.fresh_heads``, e.g. the
  LM head of a bare HF ``BertModel``) are left out: they are not the source's weights.

Each tensor is digested on its own (``sha256`` of name, shape and values, read in chunks), and the
fingerprint is the ``sha256`` of the sorted (name, digest) pairs, so tensors may arrive in any order
and only one is in memory at a time. The result reads ``w1:`` + 64 hex digits; ``w1`` names this
scheme so a later change of rule can never be mistaken for different weights.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np
import torch

from pretrain.checkpoint.types import TensorSource
from pretrain.checkpoint.work_split import SINGLE, WorkSplit
from pretrain.models.sharding import is_vocab_tensor
from pretrain.utils.errors import UserError

if TYPE_CHECKING:
    from pretrain.models.families.converter import HFConfig

SCHEME = "w1"
SHORT_HEX = 12
_CHUNK_ELEMENTS = 1 << 22  # 16 MiB of float32 per hashing step


def tensor_digest(name: str, tensor: torch.Tensor) -> bytes:
    """``sha256`` of ``name``, the shape and the values (float32 or int64, little-endian); no copy
    of the whole tensor is made (``tensor`` is read ``_CHUNK_ELEMENTS`` at a time)."""
    h = hashlib.sha256()
    kind = "f" if tensor.is_floating_point() else "i"
    if tensor.is_complex():
        raise UserError(f"tensor {name}: complex weights cannot be fingerprinted")
    h.update(struct.pack("<I", len(name.encode())) + name.encode())
    h.update(
        kind.encode() + struct.pack("<I", tensor.dim()) + struct.pack(f"<{tensor.dim()}q", *tensor.shape)
    )
    flat = tensor.detach().reshape(-1)
    target, np_type = (torch.float32, "<f4") if kind == "f" else (torch.int64, "<i8")
    # one buffer for every chunk (a fresh 64 MiB allocation per chunk costs its page faults), and
    # the bytes hashed where they lie (no copy when the host is little-endian)
    buf = torch.empty(min(flat.numel(), _CHUNK_ELEMENTS), dtype=target)
    for start in range(0, flat.numel(), _CHUNK_ELEMENTS):
        chunk = flat[start : start + _CHUNK_ELEMENTS]
        part = buf[: chunk.numel()]
        part.copy_(chunk)
        h.update(np.ascontiguousarray(part.numpy(), dtype=np_type).data.cast("B"))
    return h.digest()


def fingerprint_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    vocab_size: int | None = None,
    skip_prefixes: tuple[str, ...] = (),
) -> str:
    """The fingerprint of ``(canonical name, full tensor)`` pairs, in any order, one at a time.

    ``vocab_size``: rows kept of vocabulary tensors (``None``: as given). ``skip_prefixes``: names
    starting with one of these (followed by ``.``) are left out."""
    return combine_digests(tensor_digests(tensors, vocab_size=vocab_size, skip_prefixes=skip_prefixes))


def tensor_digests(
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    vocab_size: int | None = None,
    skip_prefixes: tuple[str, ...] = (),
    workers: int | None = None,
) -> dict[str, bytes]:
    """Each tensor's :func:`tensor_digest` by name (see :func:`fingerprint_tensors`): processes that
    each read part of a model (expert-parallel ranks) combine theirs with :func:`combine_digests`.

    Digests run on ``workers`` threads (default :func:`digest_workers`): sha256 and the float32
    widening release the GIL, so they overlap each other and the reading of the next tensor. At
    most ``workers`` tensors are held at once (the one being read included), so memory stays
    within ``workers`` x the largest tensor plus one 64 MiB buffer per thread."""
    n = digest_workers() if workers is None else max(1, workers)
    digests: dict[str, bytes] = {}
    seen: set[str] = set()
    slots = threading.BoundedSemaphore(n)
    pending: list[tuple[str, Future[bytes]]] = []

    def digest(name: str, tensor: torch.Tensor) -> bytes:
        try:
            return tensor_digest(name, tensor)
        finally:
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
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    vocab_size: int | None,
    skip_prefixes: tuple[str, ...],
    seen: set[str],
    slots: threading.BoundedSemaphore,
) -> Iterator[tuple[str, torch.Tensor]]:
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


def combine_digests(digests: Mapping[str, bytes]) -> str:
    """The fingerprint of every tensor's digest (``sha256`` of the name-sorted pairs)."""
    if not digests:
        raise UserError("the weights fingerprint needs at least one tensor")
    total = hashlib.sha256(SCHEME.encode())
    for name in sorted(digests):
        total.update(struct.pack("<I", len(name.encode())) + name.encode() + digests[name])
    return f"{SCHEME}:{total.hexdigest()}"


def weights_fingerprint(
    source: TensorSource | Mapping[str, torch.Tensor], *, vocab_size: int | None = None,
    split: WorkSplit = SINGLE, stop: threading.Event | None = None, workers: int | None = None,
) -> str:  # fmt: skip
    """The fingerprint of a canonical source (``names()``/``tensor(name)``/``spec``: a checkpoint
    reader, ``DictSource``, ``import_hf``) or of a ``{canonical name: full tensor}`` mapping.

    A source's true vocabulary (``spec.cfg.vocab_size``) and fresh heads (``spec.fresh_heads``) are
    used unless ``vocab_size`` is given; tensors are read one at a time. ``split`` (torchrun): each
    process digests its share of the tensors and the digests are gathered (collective). ``stop``:
    when set, reading ends with ``UserError`` (a background fingerprint whose conversion failed).
    ``workers``: digest threads (:func:`tensor_digests`)."""
    if isinstance(source, Mapping):
        return fingerprint_tensors(source.items(), vocab_size=vocab_size)
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
    digests = tensor_digests(
        ((n, source.tensor(n)) for n in _until(names, stop)),
        vocab_size=vocab,
        skip_prefixes=fresh,
        workers=workers,
    )
    if split.parallel:
        digests = {k: v for part in split.gather(digests) for k, v in part.items()}
    return combine_digests(digests)


def _until(names: Iterable[str], stop: threading.Event | None) -> Iterator[str]:
    for name in names:
        if stop is not None and stop.is_set():
            raise UserError("the weights fingerprint was cancelled")
        yield name


def short_fingerprint(fingerprint: str) -> str:
    """The first :data:`SHORT_HEX` hex digits, for display (``w1:3fa9c2d07b1e``)."""
    scheme, _, digest = fingerprint.partition(":")
    return f"{scheme}:{digest[:SHORT_HEX]}" if digest else fingerprint[:SHORT_HEX]


def is_fingerprint(value: object) -> bool:
    """Whether ``value`` is a fingerprint string of a known scheme (``w1:`` + 64 hex digits)."""
    if not isinstance(value, str) or not value.startswith(SCHEME + ":"):
        return False
    digest = value[len(SCHEME) + 1 :]
    return len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)


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
