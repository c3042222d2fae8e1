"""The memory figure of ``benchmarks/anon_memory.py``: a process tree's anonymous memory, each page
counted once, whatever children the command starts and however long they take to ``exec``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from benchmarks import anon_memory
from benchmarks.anon_memory import _children, _field_kb, tree_anon_bytes

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

MB = 1 << 20

# 256 MB of touched anonymous memory, then a child that shares it: ``posix_spawn`` (glibc: a
# ``clone(CLONE_VM | CLONE_VFORK)`` child, as ``subprocess`` starts its children with ``vfork``)
# whose open of a FIFO blocks before its ``exec`` until the test opens the other end; or a
# ``fork`` child that keeps the pages copy-on-write until the FIFO is written.
_HOLDER = textwrap.dedent(
    """
    import os, sys
    held = bytearray(256 << 20)
    for i in range(0, len(held), 4096):
        held[i] = 1
    fifo = sys.argv[2]
    if sys.argv[1] == "vfork":
        pid = os.posix_spawn("/bin/true", ["/bin/true"], {},
                             file_actions=[(os.POSIX_SPAWN_OPEN, 3, fifo, os.O_RDONLY, 0)])
    else:
        pid = os.fork()
        if pid == 0:
            with open(fifo, "rb") as f:
                f.read()
            os._exit(0)
    os.waitpid(pid, 0)
    """
)


def _held_tree(tmp_path: Path, how: str) -> tuple[int, int, int]:
    """``(lone, counted, children)``: the holder's ``RssAnon`` and the tree's figure while its child
    waits, and how many children it had then."""
    script, fifo = tmp_path / "hold.py", tmp_path / "fifo"
    script.write_text(_HOLDER)
    os.mkfifo(fifo)
    proc = subprocess.Popen([sys.executable, str(script), how, str(fifo)])
    try:
        deadline = time.monotonic() + 60
        while not _children(proc.pid):
            assert time.monotonic() < deadline and proc.poll() is None, "the holder never started its child"
            time.sleep(0.01)
        time.sleep(0.2)  # the fork child reaches its open()
        lone = _field_kb(f"/proc/{proc.pid}/status", "RssAnon:") * 1024
        counted, children = tree_anon_bytes(proc.pid), len(_children(proc.pid))
    finally:
        with open(fifo, "wb"):  # lets the child go on (its open returns)
            pass
        assert proc.wait(timeout=60) == 0
    return lone, counted, children


@pytest.mark.parametrize("kcmp", [True, False], ids=["kcmp", "without-kcmp"])
@pytest.mark.parametrize("how", ["vfork", "fork"])
def test_a_child_sharing_the_parents_pages_is_not_counted_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str, kcmp: bool
) -> None:
    """The CI failure this guards: reshard's ``ctypes.util.find_library`` ran ``ldconfig`` through
    ``vfork``, and a sample taken before its ``exec`` counted the converter twice (459 MB against
    230). Where the kernel refuses ``kcmp`` (a container's seccomp filter), the pages tell."""
    if not kcmp:
        monkeypatch.setattr(anon_memory, "_SYS_KCMP", None)
    elif anon_memory._same_memory(os.getpid(), os.getpid()) is not True:
        pytest.skip("kcmp(KCMP_VM) is refused here")
    lone, counted, children = _held_tree(tmp_path, how)
    assert children == 1
    assert lone > 256 * MB
    assert abs(counted - lone) < 16 * MB, (counted, lone)


@pytest.mark.slow  # 2.4-15 s on a 2-core host: out of the fast lane (under 2 min)
def test_the_converters_start_no_process_to_find_the_c_library(tmp_path: Path) -> None:
    """``madvise`` and ``sync_file_range`` come from the running interpreter (``CDLL(None)``), not
    from a library path found by running ``ldconfig`` (``ctypes.util.find_library``)."""
    probe = textwrap.dedent(
        """
        import subprocess
        def refuse(*a, **k):
            raise AssertionError("a process was started")
        subprocess.Popen.__init__ = refuse
        from pathlib import Path
        from pretrain.checkpoint.legacy.pages import PageReleaser
        from pretrain.utils.writeback import _SYNC_FILE_RANGE
        assert PageReleaser([Path(__file__)]).libc is not None and _SYNC_FILE_RANGE is not None
        """
    )
    script = tmp_path / "probe.py"
    script.write_text(probe)
    root = Path(__file__).parents[1]
    subprocess.run([sys.executable, str(script)], check=True, cwd=root,
                   env={**os.environ, "PYTHONPATH": str(root)})  # fmt: skip
