"""The weights fingerprint digested on threads: the same string as the scheme written out by hand,
at most ``workers`` tensors held at once, and a worker's failure raised to the caller."""

from __future__ import annotations

import hashlib
import struct
import threading
import weakref
from collections.abc import Iterator

import blake3
import pytest
import torch

import pretrain.checkpoint.fingerprint as fp
from pretrain.utils.errors import UserError


def _by_hand(tensors: dict[str, torch.Tensor], scheme: str) -> str:
    """The schemes spelled out. ``w1``: per tensor sha256(name, "f", shape, LE float32 values).
    ``w2``: per tensor BLAKE3(name, kind, shape, values), kind "b" with the LE bf16 bit patterns
    when every value is a bf16 number, else "f" with LE float32. Then sha256 of the scheme and
    the sorted (name, digest) pairs."""
    total = hashlib.sha256(scheme.encode())
    for name in sorted(tensors):
        t = tensors[name]
        exact = torch.equal(t.float().bfloat16().float(), t.float())
        kind = b"b" if scheme == "w2" and exact else b"f"
        h = hashlib.sha256() if scheme == "w1" else blake3.blake3()
        h.update(struct.pack("<I", len(name)) + name.encode())
        h.update(kind + struct.pack("<I", t.dim()) + struct.pack(f"<{t.dim()}q", *t.shape))
        if kind == b"b":
            h.update(t.bfloat16().view(torch.int16).numpy().astype("<i2").tobytes())
        else:
            h.update(t.float().numpy().astype("<f4").tobytes())
        total.update(struct.pack("<I", len(name)) + name.encode() + h.digest())
    return f"{scheme}:" + total.hexdigest()


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    shapes = [(7, 5), (1 << 22) + 3, (33,), (2, 3, 4), (64, 64)]  # one spans two hashing chunks
    return {f"layers.{i}.w": torch.randn(s, generator=g).to(torch.bfloat16) for i, s in enumerate(shapes * 3)}


@pytest.mark.parametrize("scheme", ["w1", "w2"])
@pytest.mark.parametrize("workers", [1, 2, 4])
def test_threaded_digests_give_the_scheme_value(workers: int, scheme: str) -> None:
    tensors = _tensors()
    # float32 storage: bf16 numbers (hashed narrowed under w2), and values that are not
    tensors["f32.bf16_numbers"] = tensors["layers.1.w"].float()
    tensors["f32.full"] = torch.randn(1 << 22, generator=torch.Generator().manual_seed(4))
    tensors["f16.values"] = torch.randn(5, 7, generator=torch.Generator().manual_seed(5)).half()
    got = fp.combine_digests(
        fp.tensor_digests(tensors.items(), workers=workers, scheme=scheme), scheme=scheme
    )
    assert got == _by_hand(tensors, scheme)
    assert (scheme == "w2") == (
        fp.combine_digests(fp.tensor_digests(tensors.items())) == got
    )  # w2 by default


def test_at_most_workers_tensors_are_alive_and_digests_run_on_threads(monkeypatch) -> None:
    alive: weakref.WeakSet[torch.Tensor] = weakref.WeakSet()
    peak, threads = [0], set()
    real = fp.tensor_digest

    def slow_digest(name: str, tensor: torch.Tensor, *, scheme: str) -> bytes:
        threads.add(threading.current_thread().name)
        threading.Event().wait(0.01)  # let the reader run ahead if it could
        return real(name, tensor, scheme=scheme)

    def source() -> Iterator[tuple[str, torch.Tensor]]:
        for i in range(12):
            t = torch.full((1000,), float(i))
            alive.add(t)
            peak[0] = max(peak[0], len(alive))
            yield f"t{i}", t

    monkeypatch.setattr(fp, "tensor_digest", slow_digest)
    digests = fp.tensor_digests(source(), workers=2)
    assert len(digests) == 12 and peak[0] <= 2
    assert len(threads) == 2 and all(n.startswith("fingerprint") for n in threads)


def test_a_failing_digest_fails_the_fingerprint() -> None:
    with pytest.raises(UserError, match="complex"):
        fp.tensor_digests([("a", torch.zeros(3)), ("b", torch.zeros(3, dtype=torch.complex64))], workers=2)
    with pytest.raises(UserError, match="given twice"):
        fp.tensor_digests([("a", torch.zeros(3)), ("a", torch.zeros(3))], workers=2)


def test_thread_count_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("MLM_FINGERPRINT_THREADS", "3")
    assert fp.digest_workers() == 3
    monkeypatch.setenv("MLM_FINGERPRINT_THREADS", "x")
    with pytest.raises(UserError, match="MLM_FINGERPRINT_THREADS"):
        fp.digest_workers()
