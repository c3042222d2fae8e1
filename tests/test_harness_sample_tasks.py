"""The lm-evaluation-harness tasks shipped with the toolkit (``mlm_eval/harness/tasks``) run offline
through the real ``mlm-lm-eval`` command line, from any directory, and ``--model mlm`` on a
checkpoint equals the harness's own ``--model hf`` on its Hugging Face export; ``--model_args``
may carry ``batch_size`` (the harness's own backends get it twice and raise ``TypeError``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mlm_eval.harness.tasks import TAG, TASK_NAMES, TASKS_DIR
from tests.harness_fixtures import export_hf

pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")


def _run(model: str, model_args: str, out: Path, *extra: str) -> dict[str, Any]:
    """``mlm-lm-eval --include_path TASKS_DIR --tasks mlm_sample`` (the tag: all four), offline; the
    results file and every sample's responses, by task."""
    from mlm_eval.harness.cli import main
    from tests.lm_eval_index import install

    install()  # the harness's own task index built once per test process
    argv = ["--model", model, "--model_args", model_args, "--include_path", str(TASKS_DIR), "--tasks", TAG,
            "--device", "cpu", "--output_path", str(out), "--log_samples", *extra]  # fmt: skip
    assert main(argv) == 0
    (results_file,) = out.rglob("results_*.json")
    resps = {}
    for task in TASK_NAMES:
        (samples,) = out.rglob(f"samples_{task}_*.jsonl")
        rows = sorted((json.loads(x) for x in samples.read_text().splitlines()), key=lambda r: r["doc_id"])
        resps[task] = [r["resps"] for r in rows]
    return {**json.loads(results_file.read_text()), "resps": resps}


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No network, and a working directory far from the tasks (their data must not be cwd-relative)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)


@pytest.mark.slow
def test_sample_tasks_mlm_equals_hf_backend(
    trained_gpt: dict[str, str], tmp_path: Path, offline: None
) -> None:
    from tests.test_harness_parity import assert_same

    hf = export_hf(trained_gpt["ckpt"], str(Path(trained_gpt["vocab"]).parent), tmp_path / "hf")
    ours = _run("mlm", f"ckpt={trained_gpt['ckpt']},batch_size=4", tmp_path / "mlm")
    ref = _run("hf", f"pretrained={hf},dtype=float32", tmp_path / "hf_out", "--batch_size", "4")
    assert set(ours["results"]) == set(TASK_NAMES) and all(len(ours["resps"][t]) > 0 for t in TASK_NAMES)
    assert len(ours["resps"]["mlm_sample_lambada"]) == 50 and len(ours["resps"]["mlm_sample_wikitext"]) == 3
    assert ours["config"]["model_args"]["batch_size"] == 4 and ours["config"]["mlm_batch_size"] == 4
    assert_same(ours, ref, rel=1e-6, tasks=TASK_NAMES)


def test_tasks_are_package_data() -> None:
    """Every shipped YAML names its task and is listed; setuptools ships ``*.yaml`` (pyproject)."""
    import tomllib

    yamls = sorted(p.stem for p in TASKS_DIR.glob("*.yaml"))
    assert yamls == sorted(TASK_NAMES)
    data = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "*.yaml" in data["package-data"]["*"]
    # the README's --include_path "$(python -m mlm_eval.harness.tasks)"
    out = subprocess.run(
        [sys.executable, "-m", "mlm_eval.harness.tasks"], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == str(TASKS_DIR)


@pytest.mark.slow  # 2.4-15 s on a 2-core host: out of the fast lane (under 2 min)
@pytest.mark.parametrize(
    ("model_args", "needle"),
    [
        ("ckpt={ckpt},batchsize=4", "--model_args batchsize=4: not an option of --model mlm (options: "),
        ("ckpt={ckpt},batch_size=four", "batch_size=four: expected a positive integer or 'auto'"),
        ("batch_size=4", "--model mlm needs --model_args ckpt=DIR"),
        ("ckpt={ckpt}/missing", "missing: no such directory"),
        ('{{"ckpt": "{ckpt}", "batchsize": 4}}', "--model_args batchsize=4: not an option of --model mlm"),
    ],
)
def test_bad_model_args_are_one_line(
    trained_gpt: dict[str, str], tmp_path: Path, model_args: str, needle: str
) -> None:
    """Through the real command (a fresh process: the harness configures logging once per process),
    refused before the harness loads its tasks or starts evaluating (no INFO line of its evaluator)."""
    argv = ["--model", "mlm", "--model_args", model_args.format(ckpt=trained_gpt["ckpt"]), "--include_path",
            str(TASKS_DIR), "--tasks", "mlm_sample_lambada", "--device", "cpu"]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "mlm_eval.harness", *argv], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=300, check=False)  # fmt: skip
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1 and needle in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and proc.stderr.rstrip().endswith(errors[0])
    assert "Setting random seed" not in proc.stderr and "Initializing mlm model" not in proc.stderr
