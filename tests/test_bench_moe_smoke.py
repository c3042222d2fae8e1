"""The MoE step benchmark runs (tiny shapes) and its last line is the JSON the issue names; its
two models compute the same loss (the benchmark compares like with like)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_moe_step_quick_reports_ratio_and_equal_losses() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_moe_step.py"), "--quick"],
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout  # fmt: skip
    result = json.loads(out.strip().splitlines()[-1])
    assert result["ratio"] > 0 and result["loss_diff"] < 1e-5
