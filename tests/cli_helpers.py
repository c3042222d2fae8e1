"""Assertions shared by the command-line edge tests: one-line errors and light ``--help``."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest


def one_line_error(
    main: Callable[[list[str]], object], argv: list[str], capsys: pytest.CaptureFixture[str]
) -> str:
    """Run ``main(argv)``; it must exit 2 with exactly one ``error: ...`` line on stderr (returned)."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


def help_output_and_heavy_imports(module: str, heavy: Sequence[str]) -> tuple[str, list[str]]:
    """``module.main(['--help'])`` in a fresh interpreter: its stdout and which of ``heavy`` it imported."""
    code = (
        f"import sys\nfrom {module} import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        f"print('HEAVY', sorted(m for m in {tuple(heavy)!r} if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out, _, loaded = proc.stdout.rpartition("HEAVY ")
    return out, eval(loaded)  # a printed list of module names


def truncated_weights_copy(hf_dir: Path, dst: Path) -> tuple[Path, Path]:
    """A copy of Hugging Face directory ``hf_dir`` at ``dst`` whose ``model.safetensors`` is cut in
    half; returns ``(dst, the truncated file)``."""
    shutil.copytree(hf_dir, dst)
    weights = dst / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return dst, weights
