"""The activation-memory and MFU benchmarks run (CPU smoke shapes) and end with their JSON fields."""

from __future__ import annotations

import json

import pytest


def _last_json(capsys: pytest.CaptureFixture[str]) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_bench_mfu_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.bench_mfu import main

    assert main(["--smoke", "--steps", "1", "--device", "cpu"]) == 0
    out = _last_json(capsys)
    assert set(out["models"]) == {"gpt2_1.2b", "llama_1b"}
    for r in out["models"].values():
        assert r["mfu"] > 0 and r["ratio"] > 0 and r["flops_per_step"] > 0
    assert out["mfu"] == min(r["mfu"] for r in out["models"].values())


@pytest.mark.slow
def test_bench_activation_memory_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.bench_activation_memory import main

    assert main(["--smoke"]) == 0
    out = _last_json(capsys)
    tp2 = out["per_tp"]["2"]
    assert tp2["tp_sp"]["saved_bytes"] < tp2["tp"]["saved_bytes"]  # norms and dropout masks sharded
    assert out["sp_selective_over_tp"] < 0.5
    assert 0 < out["recompute_flops_overhead"] < 0.05
    # sequence parallelism changes where bytes live, never the FLOPs of a rank
    assert tp2["tp_sp"]["fwd_flops"] == tp2["tp"]["fwd_flops"]
