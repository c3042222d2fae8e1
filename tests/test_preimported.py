"""``tests.preimported.run_python`` runs a script as ``subprocess.run(..., capture_output=True,
text=True)`` does: the same arguments, working directory, environment, output and exit code (an
exception's traceback and 1), and a timeout raises ``TimeoutExpired`` after killing the script and
the processes it started."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.preimported import run_python, server_env

SCRIPT = """
import json, os, sys, time
mode = sys.argv[1]
if mode == "report":
    print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "probe": os.environ.get("PROBE_VAR"),
                      "path0": sys.path[0], "stdin": sys.stdin.read()}))
    print("to stderr", file=sys.stderr)
    sys.exit(int(sys.argv[2]))
if mode == "modules":
    print("torch" in sys.modules)
if mode == "raise":
    raise ValueError("boom")
if mode == "sleep":  # a child in the same process group, as a peer's ranks are
    pid = os.fork()
    if pid == 0:
        time.sleep(120)
        os._exit(0)
    print(pid, flush=True)
    time.sleep(120)
"""


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "probe_script.py"
    path.write_text(SCRIPT)
    return path


@pytest.mark.slow
def test_a_script_runs_as_in_a_fresh_interpreter(script: Path, tmp_path: Path) -> None:
    env = server_env({"PROBE_VAR": "seen"})
    for argv in (["report", "0", "x y"], ["report", "3"], ["raise"]):
        ours = run_python(str(script), argv, env=env, cwd=tmp_path)
        fresh = subprocess.run([sys.executable, str(script), *argv], cwd=tmp_path, env=env, capture_output=True,
                               text=True, stdin=subprocess.DEVNULL)  # fmt: skip
        assert (ours.returncode, ours.stdout) == (fresh.returncode, fresh.stdout), argv
        assert ours.stderr.splitlines()[-1] == fresh.stderr.splitlines()[-1], (ours.stderr, fresh.stderr)
    report = json.loads(run_python(str(script), ["report", "0"], env=env, cwd=tmp_path).stdout)
    assert report == {"argv": ["report", "0"], "cwd": str(tmp_path), "probe": "seen", "path0": str(tmp_path),
                      "stdin": ""}  # fmt: skip


@pytest.mark.slow
def test_an_environment_read_at_import_gets_a_fresh_interpreter(script: Path, tmp_path: Path) -> None:
    """The server's imports were made under its own ``OMP_NUM_THREADS``: another one runs afresh."""
    served = run_python(str(script), ["modules"], cwd=tmp_path)
    fresh = run_python(str(script), ["modules"], env=server_env({"OMP_NUM_THREADS": "3"}), cwd=tmp_path)
    assert (served.stdout.strip(), fresh.stdout.strip()) == ("True", "False")


@pytest.mark.slow
def test_a_timeout_kills_the_script_and_its_children(script: Path, tmp_path: Path) -> None:
    with pytest.raises(subprocess.TimeoutExpired) as stop:
        run_python(str(script), ["sleep"], cwd=tmp_path, timeout=3)
    child = int(str(stop.value.stdout).split()[0])
    time.sleep(0.5)
    stat = Path(f"/proc/{child}/stat")
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"  # gone, or a zombie
