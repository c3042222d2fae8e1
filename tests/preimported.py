"""Run the test-only megatron-core peers (``python -m tests.megatron_core_*``) in processes forked
from one server that imported megatron-core once.

``import megatron.core.models.gpt`` and its checkpointing take about 10 s of CPU on a 2-core host:
most of a peer's run (a ``save`` of the Llama case: 16 s, 10 of them the import). The suite runs
dozens. :func:`run_python` runs ``python -m MODULE ARGV`` (or ``python SCRIPT ARGV``) as
``subprocess.run(..., capture_output=True, text=True)`` would, but in a ``fork`` of this pytest
worker's server (started on first use, with :data:`PRELOAD` imported and no torch op run, so no
thread pool exists to break), each request a fresh child:

* the child gets the request's environment, working directory, ``sys.argv`` and fresh stdout and
  stderr files (their text is returned), and exits as the interpreter would (``SystemExit``'s
  code; a traceback and 1 for an exception; ``atexit`` handlers run);
* it leads its own process group, so a timeout kills it and any ranks it forked
  (``subprocess.TimeoutExpired`` is raised, as ``subprocess.run`` raises it);
* a request whose environment differs from the server's in a variable read at import or library
  load (:data:`IMPORT_TIME_VARS`) runs as a plain subprocess instead.

What the peers print at import (megatron-core's "Transformer Engine and Apex are not installed"
warnings) goes to the server's stderr, not the child's. Only for test-only scripts: a command of
ours whose own output is under test runs as a real subprocess, or under :mod:`tests.forked_launch`.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib
import importlib.util
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[1]
PRELOAD = (
    "torch._dynamo",
    "torch.distributed.checkpoint",
    "megatron.core.models.gpt",
    "megatron.core.models.bert.bert_model",
    "megatron.core.dist_checkpointing",
    "megatron.core.optimizer",
    "megatron.core.transformer.moe.moe_layer",
    "tests.megatron_core_peer",
)
IMPORT_TIME_VARS = (
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONPATH", "PYTHONHASHSEED", "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "MALLOC_MMAP_THRESHOLD_",
)  # fmt: skip


def server_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a peer runs in by default: this one, one thread, the repository on the path."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}


def run_python(
    target: str, argv: list[str], *, env: Mapping[str, str] | None = None, cwd: Path = ROOT, timeout: float = 900.0
) -> subprocess.CompletedProcess[str]:  # fmt: skip
    """``python -m TARGET ARGV`` (``python TARGET ARGV`` when ``TARGET`` ends in ``.py``) in ``cwd``
    with ``env`` (default :func:`server_env`), output captured as text, as ``subprocess.run``."""
    env = dict(server_env() if env is None else env)
    cmd = [sys.executable, target] if target.endswith(".py") else [sys.executable, "-m", target]
    if _differs(env, server_env()) or _differs(env, _server().env):  # started only when it may serve
        return subprocess.run(
            [*cmd, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
        )
    return _server().run(cmd, target, argv, env, cwd, timeout)


def _differs(env: Mapping[str, str], base: Mapping[str, str]) -> bool:
    """Whether ``env`` and ``base`` differ in a variable read at import or library load."""
    return any(env.get(k) != base.get(k) for k in IMPORT_TIME_VARS)


class _Server:
    """The client side: the server process, requests as JSON lines on its stdin, answers on its stdout."""

    def __init__(self) -> None:
        self.env = server_env()
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.preimported", *PRELOAD], cwd=ROOT, env=self.env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.stdin, self.answers, self.pending = self.proc.stdin, self.proc.stdout.fileno(), b""
        if self._answer(600.0) != {"ready": True}:
            raise RuntimeError("tests.preimported: the server did not start")
        atexit.register(self.close)

    def run(self, cmd: list[str], target: str, argv: list[str], env: dict[str, str], cwd: Path,
            timeout: float) -> subprocess.CompletedProcess[str]:  # fmt: skip
        with tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
            request = {"target": target, "argv": argv, "env": env, "cwd": str(cwd), "stdout": str(out),
                       "stderr": str(err)}  # fmt: skip
            self.stdin.write(json.dumps(request) + "\n")
            self.stdin.flush()
            pid = self._answer(60.0)["pid"]
            answer = self._answer(timeout)
            if answer is None:  # the child's group: the peer and the ranks it forked
                with_group(pid, signal.SIGKILL)
                self._answer(60.0)
                raise subprocess.TimeoutExpired([*cmd, *argv], timeout, out.read_text(), err.read_text())
            return subprocess.CompletedProcess([*cmd, *argv], answer["rc"], out.read_text(), err.read_text())

    def _answer(self, timeout: float) -> Any:
        """The server's next answer line, None after ``timeout`` s without one (read from the raw
        pipe: a buffered reader could hold a second answer that ``select`` then never reports)."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.pending:
            ready, _, _ = select.select([self.answers], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return None
            chunk = os.read(self.answers, 65536)
            if not chunk:
                raise RuntimeError("tests.preimported: the server exited")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.stdin.close()
            self.proc.wait(30)


@functools.cache
def _server_of(pid: int) -> _Server:
    return _Server()


def _server() -> _Server:
    return _server_of(os.getpid())  # a forked test process starts its own


def with_group(pid: int, sig: int) -> None:
    """``sig`` to the process group led by ``pid`` (gone already: nothing)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)


def _child(request: dict[str, Any]) -> None:
    """In the forked child: become ``python [-m] TARGET ARGV`` and exit as it would."""
    os.setpgid(0, 0)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_CREAT),
                            (2, request["stderr"], os.O_WRONLY | os.O_CREAT)):  # fmt: skip
        f = os.open(path, flags, 0o644)
        os.dup2(f, fd)
        os.close(f)
    # not the server's reader of requests, whose buffer may hold the next ones
    sys.stdin = os.fdopen(0, encoding="utf-8", closefd=False)  # noqa: SIM115
    target, code = request["target"], 0
    sys.modules.pop(target, None)  # run afresh as __main__ (a preloaded copy would make runpy warn)
    try:
        if target.endswith(".py"):
            sys.argv = [target, *request["argv"]]
            sys.path[0] = str(Path(target).resolve().parent)
            runpy.run_path(target, run_name="__main__")
        else:
            sys.argv = [target, *request["argv"]]
            sys.path[0] = request["cwd"]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        code = _exit_code(stop.code)
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _exit_code(code: object) -> int:
    """The status ``sys.exit(code)`` gives: None 0, an int itself, anything else printed and 1."""
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


def serve(preload: list[str], answers: IO[str]) -> None:
    """Import ``preload``, then run each request line of stdin in a forked child."""
    for module in preload:  # a test-only extra not installed: its peers skip themselves
        if importlib.util.find_spec(module.partition(".")[0]) is not None:
            importlib.import_module(module)
    answers.write(json.dumps({"ready": True}) + "\n")
    answers.flush()
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            answers.close()
            _child(request)
        answers.write(json.dumps({"pid": pid}) + "\n")
        answers.flush()
        _, status = os.waitpid(pid, 0)
        answers.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")
        answers.flush()


if __name__ == "__main__":
    from pretrain.utils.libc import libc

    c_library = libc()
    if c_library is not None:  # the server dies with its pytest worker
        c_library.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    # answers on a private copy of stdout; what imports or children print goes to stderr
    protocol = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    serve(sys.argv[1:], protocol)
