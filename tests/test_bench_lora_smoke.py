"""The LoRA benchmark runs (tiny Llama, two steps, two alternating repeats): its last line is the
JSON the issue names, with CPU time and per-side peak RSS, and both sides compute the same loss.

Our side runs eager (``--fused-kernels off``): compiling the fused loops in each of its processes
would double the test's time, and ``tests/test_fused_kernels.py`` checks the fused model step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("schedule", "loss_fraction", "repeats"), [("interleaved", 1.0, 2), ("sequential", 0.5, 1)]
)
def test_bench_lora_tiny_reports_ratios_and_equal_losses(
    schedule: str, loss_fraction: float, repeats: int
) -> None:
    """Both schedules give the same losses; interleaved runs also time each step of both sides in
    turn (``step_ratio_median``), and two repeats report a ratio each. With half of each row a
    prompt without loss (ours: the loss mask, its output layer on the other half's rows; theirs:
    labels -100) the losses agree too."""
    argv = [sys.executable, "-m", "benchmarks.bench_lora", "--size", "tiny", "--steps", "3", "--warmup", "1", "--seq", "32",
            "--repeats", str(repeats), "--threads", "1", "--fused-kernels", "off", "--schedule", schedule,
            "--loss-fraction", str(loss_fraction)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(argv, capture_output=True, text=True, check=True, cwd=ROOT, env=env).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result["loss_diff"] < 1e-5
    assert result["ratio"] > 0 and result["cpu_ratio"] > 0 and 0 < result["peak_rss_ratio"] < 2
    assert len(result["ratios"]) == repeats and result["threads"] == 1 and result["fused_kernels"] is False
    assert result["ours_built_rss_mb"] > 0 and result["schedule"] == schedule
    assert (result["step_ratio_median"] is None) == (schedule == "sequential")
    assert result["loss_fraction"] == loss_fraction and result["loss_tokens_per_row"] == 32 * loss_fraction
