"""The weights fingerprint digested on threads: the same string as the scheme written out by hand,
at most ``workers`` tensors held at once, and a worker's failure raised to the caller."""

from __future__ import annotations

import hashlib
import struct
import threading
import weakref
from collections.abc import Iterator

import pytest
import torch

import pretrain.checkpoint.fingerprint as fp
from pretrain.utils.errors import UserError


def _by_hand(tensors: dict[str, torch.Tensor]) -> str:
    """Scheme ``w1`` spelled out: per tensor sha256(name, kind, shape, LE float32 values); then
    sha256 of the sorted (name, digest) pairs."""
    total = hashlib.sha256(b"w1")
    for name in sorted(tensors):
        t = tensors[name]
        h = hashlib.sha256(struct.pack("<I", len(name)) + name.encode())
        h.update(b"f" + struct.pack("<I", t.dim()) + struct.pack(f"<{t.dim()}q", *t.shape))
        h.update(t.float().numpy().astype("<f4").tobytes())
        total.update(struct.pack("<I", len(name)) + name.encode() + h.digest())
    return "w1:" + total.hexdigest()


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    shapes = [(7, 5), (1 << 22) + 3, (33,), (2, 3, 4), (64, 64)]  # one spans two hashing chunks
    return {f"layers.{i}.w": torch.randn(s, generator=g).to(torch.bfloat16) for i, s in enumerate(shapes * 3)}


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_threaded_digests_give_the_scheme_value(workers: int) -> None:
    tensors = _tensors()
    got = fp.combine_digests(fp.tensor_digests(tensors.items(), workers=workers))
    assert got == _by_hand(tensors)


def test_at_most_workers_tensors_are_alive_and_digests_run_on_threads(monkeypatch) -> None:
    alive: weakref.WeakSet[torch.Tensor] = weakref.WeakSet()
    peak, threads = [0], set()
    real = fp.tensor_digest

    def slow_digest(name: str, tensor: torch.Tensor) -> bytes:
        threads.add(threading.current_thread().name)
        threading.Event().wait(0.01)  # let the reader run ahead if it could
        return real(name, tensor)

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
