"""A console script asks for huge pages and exits without the interpreter's teardown, and loses nothing doing so.

Each case runs in a fresh interpreter: ``os._exit`` would end the test process itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


def _run(body: str, tmp_path: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    script = textwrap.dedent(
        """
        import atexit, sys, tempfile, threading, time
        from pathlib import Path
        from pretrain.utils.console import run_console_script
        out = Path(sys.argv[1])
        """
    ) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True,
                          timeout=120, check=False, env=env)  # fmt: skip


@pytest.mark.parametrize(("raised", "code", "stderr"), [("0", 0, ""), ("3", 3, ""), ("None", 0, ""),
                                                        ("'a message'", 1, "a message")])  # fmt: skip
def test_system_exit_keeps_its_meaning(tmp_path: Path, raised: str, code: int, stderr: str) -> None:
    done = _run(f"def main():\n    raise SystemExit({raised})\nrun_console_script(main)\n", tmp_path)
    assert done.returncode == code
    assert done.stderr.strip() == stderr


def test_returned_code_is_the_exit_code(tmp_path: Path) -> None:
    assert _run("run_console_script(lambda: 2)\n", tmp_path).returncode == 2
    assert _run("run_console_script(lambda: None)\n", tmp_path).returncode == 0


def test_exit_runs_what_correctness_needs(tmp_path: Path) -> None:
    """Buffered prints are flushed, atexit handlers run, temp dirs are removed, a non-daemon thread
    finishes its write, and exit comes after all of it."""
    body = """
    tmp = tempfile.TemporaryDirectory()  # removed by its atexit finalizer
    (out / "tmpdir").write_text(tmp.name)
    atexit.register(lambda: (out / "atexit").write_text("ran"))
    def slow_writer():
        time.sleep(0.5)
        (out / "thread").write_text("done")
    def main():
        threading.Thread(target=slow_writer).start()
        sys.stdout.write("no newline, still buffered")
        return 0
    run_console_script(main)
    """
    done = _run(body, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "no newline, still buffered"
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "thread").read_text() == "done"
    assert not Path((tmp_path / "tmpdir").read_text()).exists()


def test_a_bug_keeps_its_traceback(tmp_path: Path) -> None:
    done = _run("def main():\n    raise RuntimeError('a bug')\nrun_console_script(main)\n", tmp_path)
    assert done.returncode == 1
    assert "Traceback" in done.stderr and "RuntimeError: a bug" in done.stderr


@pytest.mark.slow  # 2.4-15 s on a 2-core host: out of the fast lane (under 2 min)
def test_mlm_convert_console_script_reports_user_errors(tmp_path: Path) -> None:
    """The installed entry goes through ``console_main``: a bad --load is one line and exit 2."""
    missing = tmp_path / "no_such_checkpoint"
    done = subprocess.run([sys.executable, "-m", "tools.convert_cli", "reshard", "--load", str(missing),
                           "--save", str(tmp_path / "out"), "--target-tp", "1", "--target-pp", "1"],
                          capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(missing) in lines[0]


@pytest.mark.parametrize(("given", "seen"), [(None, "1"), ("0", "0")])
def test_huge_pages_asked_for_unless_the_user_chose(tmp_path: Path, given: str | None, seen: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if given is not None:
        env["THP_MEM_ALLOC_ENABLE"] = given
    body = "import os\nrun_console_script(lambda: print(os.environ['THP_MEM_ALLOC_ENABLE']))\n"
    done = _run(body, tmp_path, env=env)
    assert (done.returncode, done.stdout.strip()) == (0, seen)


@pytest.mark.parametrize(("given", "seen"), [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_mlm_convert_lets_openmp_threads_sleep_unless_the_user_chose(given: str | None, seen: str) -> None:
    """``mlm-convert`` sets ``OMP_WAIT_POLICY`` before torch (and libgomp) load, unless the user did."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if given is not None:
        env["OMP_WAIT_POLICY"] = given
    body = (
        "import os, sys\nimport tools.convert_cli as cli\n"
        "cli.main = lambda: print(os.environ['OMP_WAIT_POLICY'], 'torch' in sys.modules)\ncli.console_main()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", body], capture_output=True, text=True, env=env, timeout=120, check=False
    )
    assert (done.returncode, done.stdout.split()) == (0, [seen, "False"]), done.stderr


@pytest.mark.slow  # 2.4-15 s on a 2-core host: out of the fast lane (under 2 min)
def test_torch_is_imported_with_the_collector_paused_then_frozen(tmp_path: Path) -> None:
    """``import_torch_frozen``: torch imported, no collection ran during the import, every object
    alive then in the permanent generation, and the collector on again for what comes after."""
    body = """
    import gc
    from pretrain.utils.console import import_torch_frozen
    collections = []
    gc.callbacks.append(lambda phase, info: collections.append(info["generation"]) if phase == "start" else None)
    assert "torch" not in sys.modules
    import_torch_frozen()
    print("torch" in sys.modules, collections == [], gc.get_freeze_count() > 100_000, gc.isenabled())
    import_torch_frozen()  # a second call: nothing
    """
    done = _run(body, tmp_path)
    assert (done.returncode, done.stdout.split()) == (0, ["True"] * 4), done.stderr


def test_mlm_convert_help_does_not_import_torch() -> None:
    body = (
        "import sys\nimport tools.convert_cli as cli\ntry:\n    cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print('torch imported:', 'torch' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", body], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0 and "to-hf" in done.stdout, done.stderr
    assert done.stdout.splitlines()[-1] == "torch imported: False"
