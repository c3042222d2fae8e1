"""The write pipeline of the checkpoint writers (:class:`~pretrain.checkpoint.legacy.stream_save.WritePipeline`):
the next batch is made while one is written only where the bytes of both fit in the cap (the
largest batch's, so memory stays what lockstep holds); errors surface; nothing runs after it ends."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

import pretrain.checkpoint.legacy.stream_save as ss


@pytest.fixture
def two_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ss.os, "cpu_count", lambda: 2)


def _batch(log: list[str], name: str, release: threading.Event) -> Callable[[], list[Callable[[], None]]]:
    """A batch of two writes that block until ``release``; making and writing are logged."""

    def make() -> list[Callable[[], None]]:
        log.append(f"make {name}")

        def write(part: int) -> None:
            assert release.wait(10)
            log.append(f"wrote {name}{part}")

        return [lambda: write(0), lambda: write(1)]

    return make


def _two_batches(first_bytes: int, second_bytes: int, cap: int) -> list[str]:
    """Batch "a" (its writes finish 0.2 s in), then batch "b"; what was made and written, in order."""
    log: list[str] = []
    first, second = threading.Event(), threading.Event()
    first_done = threading.Timer(0.2, first.set)
    first_done.start()
    with ss.writers(2, cap=cap) as pipeline:
        pipeline.run(_batch(log, "a", first), first_bytes)
        pipeline.run(_batch(log, "b", second), second_bytes)
        second.set()
    first_done.join()
    return log


@pytest.mark.usefixtures("two_cpus")
def test_the_next_batch_is_made_while_one_is_written_when_both_fit_the_cap() -> None:
    log = _two_batches(60, 40, cap=100)  # 60 + 40 fit: "b" made while "a" is still written
    assert log[:2] == ["make a", "make b"]
    assert sorted(log[2:4]) == ["wrote a0", "wrote a1"] and sorted(log[4:]) == ["wrote b0", "wrote b1"]


@pytest.mark.usefixtures("two_cpus")
def test_a_batch_over_the_cap_waits_for_the_one_being_written() -> None:
    log = _two_batches(60, 41, cap=100)  # 101 > 100: "a" is finished first
    assert log.index("make b") > max(log.index("wrote a0"), log.index("wrote a1"))


@pytest.mark.usefixtures("two_cpus")
def test_an_error_in_a_write_surfaces_and_every_write_has_ended() -> None:
    running = threading.Event()
    ended: list[str] = []

    def bad() -> None:
        raise OSError("disk full")

    def slow() -> None:
        running.wait(0.3)
        ended.append("slow")

    with pytest.raises(OSError, match="disk full"), ss.writers(2, cap=10) as pipeline:
        pipeline.run(lambda: [bad, slow], 5)
        pipeline.run(lambda: [], 0)
    assert ended == ["slow"]  # (the writer was not left running)


def test_on_one_cpu_each_batch_is_written_when_made(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ss.os, "cpu_count", lambda: 1)
    log: list[str] = []
    released = threading.Event()
    released.set()
    with ss.writers(2, cap=100) as pipeline:
        pipeline.run(_batch(log, "a", released), 10)
        assert log == ["make a", "wrote a0", "wrote a1"]
