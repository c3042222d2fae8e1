"""lm-evaluation-harness offline on local tasks: ``--model mlm`` (our checkpoint, any layout) equals ``--model hf``.

A small GPT is trained, exported with ``mlm-convert to-hf``, and both sides run the same four
local tasks (lambada-style acc/perplexity, wikitext-style rolling word_perplexity/bits_per_byte,
multiple choice acc/acc_norm, generate_until exact_match). Aggregates agree to 1e-6 relative in
fp32; every per-request log-likelihood too, and every generation is the same string.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.distributed import launch
from tests.harness_fixtures import TASK_NAMES, export_hf, write_tasks
from tests.lm_eval_index import LM_EVAL_INDEX, task_manager

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from pretrain.training.cli import main as pretrain_main
    from tests.train_fixtures import gpt_args, make_gpt_data

    root = tmp_path_factory.mktemp("harness")
    data = make_gpt_data(root)
    ckpt = root / "ckpt"
    assert pretrain_main(gpt_args(data, **{"train-iters": 20, "save": ckpt, "num-layers": 2})) == 0
    hf = export_hf(str(ckpt), str(Path(data["vocab"]).parent), root / "hf")
    tasks = write_tasks(root)
    mlm = _evaluate("mlm", f"ckpt={ckpt}", tasks)
    return {"root": root, "ckpt": ckpt, "hf": hf, "tasks": tasks, "mlm": mlm}


def _evaluate(model: str, model_args: str, tasks: Path) -> dict[str, Any]:
    from lm_eval import simple_evaluate

    import mlm_eval.harness.backend  # noqa: F401

    out = simple_evaluate(model=model, model_args=model_args, tasks=list(TASK_NAMES),
                          task_manager=task_manager(tasks), device="cpu", batch_size=4,
                          log_samples=True)  # fmt: skip
    assert out is not None
    return {
        "results": out["results"],
        "resps": {t: [s["resps"] for s in out["samples"][t]] for t in TASK_NAMES},
    }


def _numbers(x: Any) -> list[Any]:
    """Flattened values; the harness's sample files store numbers and flags as strings."""
    if isinstance(x, (list, tuple)):
        return [n for item in x for n in _numbers(item)]
    if isinstance(x, str) and x in ("True", "False"):
        return [x == "True"]
    if isinstance(x, str):
        try:
            return [float(x)]
        except ValueError:
            return [x]
    return [x]


def assert_same(
    ours: dict[str, Any], ref: dict[str, Any], rel: float, tasks: tuple[str, ...] = TASK_NAMES
) -> None:
    for task in tasks:
        for key, value in ref["results"][task].items():
            if isinstance(value, float) and "stderr" not in key:
                assert ours["results"][task][key] == pytest.approx(value, rel=rel), (task, key)
        a, b = _numbers(ours["resps"][task]), _numbers(ref["resps"][task])
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert x == (pytest.approx(y, rel=rel) if isinstance(y, float) else y), task


def test_mlm_backend_equals_hf_backend_on_the_export(setup: dict[str, Any]) -> None:
    hf = _evaluate("hf", f"pretrained={setup['hf']},dtype=float32", setup["tasks"])
    assert_same(setup["mlm"], hf, rel=1e-6)
    mc = setup["mlm"]["results"]["mc_local"]
    assert 0 < mc["acc,none"] < 1 and setup["mlm"]["results"]["wiki_local"]["bits_per_byte,none"] > 0
    generated = _numbers(setup["mlm"]["resps"]["gen_local"])
    assert any(text.strip() for text in generated)  # the generations are not all empty


@pytest.mark.parametrize(("nproc", "layout"), [(4, "tp=2,pp=2"), (2, "tp=1")])
def test_mlm_backend_under_torchrun_equals_one_process(
    setup: dict[str, Any], nproc: int, layout: str
) -> None:
    out = setup["root"] / f"torchrun-{nproc}"
    argv = ["--model", "mlm", "--model_args", f"ckpt={setup['ckpt']},{layout}", "--tasks", ",".join(TASK_NAMES),
            "--include_path", str(setup["tasks"]), "--batch_size", "4", "--output_path", str(out),
            "--log_samples"]  # fmt: skip
    proc = launch(nproc, "mlm_eval.harness", argv, env={"HF_DATASETS_OFFLINE": "1"}, preload=LM_EVAL_INDEX)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (results_file,) = out.rglob("results_*.json")
    results = json.loads(results_file.read_text())["results"]
    resps: dict[str, Any] = {}
    for task in TASK_NAMES:
        (samples,) = out.rglob(f"samples_{task}_*.jsonl")
        rows = sorted(
            (json.loads(line) for line in samples.read_text().splitlines()), key=lambda r: r["doc_id"]
        )
        resps[task] = [r["resps"] for r in rows]
    assert_same({"results": results, "resps": resps}, setup["mlm"], rel=1e-6)


def test_greedy_mlm_generate_equals_transformers_generate(
    setup: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mlm_eval.generation.cli import main as generate_main

    prompts = ["The quick brown fox", "Once upon a time, in a land far", "It was"]
    outs = {}
    for extra in ([], ["--no-cache"]):
        argv = ["--ckpt", str(setup["ckpt"]), "--max-new-tokens", "12", "--json", *extra]
        assert generate_main([*argv, *(a for p in prompts for a in ("--prompt", p))]) == 0
        outs[bool(extra)] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert outs[True] == outs[False]  # cached == uncached
    hf = AutoModelForCausalLM.from_pretrained(setup["hf"]).eval()
    tok = AutoTokenizer.from_pretrained(setup["hf"])
    for prompt, ours in zip(prompts, outs[False], strict=True):
        ids = torch.tensor([tok.encode(prompt)])
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.eos_token_id)
        ref_new = ref[0, ids.shape[1] :].tolist()
        if tok.eos_token_id in ref_new:
            ref_new = ref_new[: ref_new.index(tok.eos_token_id)]
        assert ours["tokens"] == ref_new and ours["text"] == tok.decode(ref_new)
