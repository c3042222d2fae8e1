"""The MoE to-hf benchmark runs (``--quick``: tiny shapes) and its last line is the JSON the issue
names (``to_hf_peak_rss_over_model``, ``mb_per_s``), with the export's files written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_convert_moe_quick_reports_rss_and_speed(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    argv = [sys.executable, "-m", "benchmarks.bench_convert_moe", "--quick", "--workdir", str(tmp_path)]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, cwd=ROOT, env=env).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result["experts"] == 8 and result["to_hf_peak_rss_over_model"] > 0 and result["mb_per_s"] > 0
    assert "model.safetensors" in result["hf_files"] and "config.json" in result["hf_files"]
