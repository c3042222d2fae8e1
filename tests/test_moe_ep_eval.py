"""Evaluation of a mixture-of-experts checkpoint with its experts split over ranks (``--ep 2``).

A tiny random Qwen2-MoE (6 experts, a dense layer, a gated shared expert) converted with
``from-hf``, once in one file per rank (EP 1) and once as an EP checkpoint (``--ep 2``: legacy files
per EP rank; and ``torch_dist``): ``mlm-eval`` WikiText (adjusted perplexity) and LAMBADA in one
process and under ``torchrun --ep 2`` equal ``--hf-model`` on the original; ``--model mlm`` with
``ep=2`` equals one process on the harness's loglikelihood tasks, and on the EP checkpoint all four
harness tasks (``generate_until`` included) equal ``--model hf`` on the original, in one process
and at ``ep=2``; TP 2 x EP 2 with ETP 1 and PP 2 x EP 2 too. ``mlm-generate --ep 2`` (KV cache,
three prompts over two replicas) equals ``--hf-model`` and one process token for token.
WikiText's 243 windows split 122/121 over the two replicas, so the replica with fewer rows must
still pair every expert all-to-all. Refusals: ``--ep`` in one process, on a dense checkpoint,
experts not divisible by EP, a world not divisible by EP.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from mlm_eval.builtin import builtin_path
from mlm_eval.cli import main as eval_main
from tests.distributed import launch, launch_command, torchrun_env
from tests.llama_fixtures import qwen_style_bpe_tokenizer
from tests.lm_eval_index import LM_EVAL_INDEX, task_manager
from tests.moe_hf_fixtures import hf_model
from tools.convert_cli import main as convert_main

pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
WIKI = ["wikitext103", "--data", "builtin:wikitext_sample.tokens", "--seq-length", "32", "--overlap", "8",
        "--method", "paper"]  # fmt: skip
LAMBADA = ["lambada", "--data", str(builtin_path("lambada_sample.jsonl"))]
LOGLIKELIHOOD_TASKS = ("lambada_local", "wiki_local", "mc_local")


def _convert(root: Path, *, num_experts: int = 6) -> tuple[Path, Path]:
    tok = qwen_style_bpe_tokenizer()
    model = hf_model("qwen2_moe", vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                     pad_token_id=tok.pad_token_id, max_position_embeddings=256, num_experts=num_experts)  # fmt: skip
    model.save_pretrained(root / "hf")
    tok.save_pretrained(root / "hf")
    assert convert_main(["from-hf", "--load", str(root / "hf"), "--save", str(root / "ck")]) == 0
    return root / "hf", root / "ck"


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("epeval")
    hf, ck = _convert(root)
    for name, flags in (("ck-ep2", []), ("ck-ep2-dist", ["--ckpt-format", "torch_dist"])):
        assert (
            convert_main(["from-hf", "--load", str(hf), "--save", str(root / name), "--ep", "2", *flags]) == 0
        )
    assert (root / "ck-ep2" / "release" / "mp_rank_00_001").is_dir()  # one file per EP rank
    return {"root": root, "hf": hf, "ck": ck, "ck-ep2": root / "ck-ep2", "ck-ep2-dist": root / "ck-ep2-dist"}


def _eval(args: list[str], out: Path) -> dict[str, Any]:
    assert eval_main([*args, "--out", str(out), "--no-progress"]) == 0
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def _launch(args: list[str], out: Path, nproc: int, flags: list[str]) -> subprocess.Popen[str]:
    cmd = launch_command(nproc, "mlm_eval.cli", [*args, *flags, "--out", str(out), "--no-progress"])
    return subprocess.Popen(
        cmd, env=torchrun_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


RUNS = {  # name -> (task, processes, flags, the layout the result records[, checkpoint: default "ck"])
    "wiki-ep2": ("wiki", 2, ["--ep", "2"], "tp1-pp1-dp2-ep2"),
    "lambada-ep2": ("lambada", 2, ["--ep", "2"], "tp1-pp1-dp2-ep2"),
    "wiki-tp2-ep2-etp1": ("wiki", 4, ["--tp", "2", "--ep", "2", "--etp", "1"], "tp2-pp1-dp2-ep2-etp1"),
    "lambada-pp2-ep2": ("lambada", 4, ["--pp", "2", "--ep", "2"], "tp1-pp2-dp2-ep2"),
    # EP checkpoints: legacy files per EP rank (each rank opens its own), torch_dist (its experts' regions)
    "wiki-ep2-of-ep2-files": ("wiki", 2, ["--ep", "2"], "tp1-pp1-dp2-ep2", "ck-ep2"),
    "lambada-ep2-of-ep2-files": ("lambada", 2, ["--ep", "2"], "tp1-pp1-dp2-ep2", "ck-ep2"),
    "lambada-ep2-of-torch-dist": ("lambada", 2, ["--ep", "2"], "tp1-pp1-dp2-ep2", "ck-ep2-dist"),
}


@pytest.mark.slow
def test_ep_eval_equals_hf_model(moe: dict[str, Path]) -> None:
    root, tasks = moe["root"], {"wiki": WIKI, "lambada": LAMBADA}
    procs = {name: _launch([*tasks[run[0]], "--ckpt", str(moe[run[4] if len(run) > 4 else "ck"])],
                           root / f"{name}.json", run[1], run[2])
             for name, run in RUNS.items()}  # fmt: skip
    want = {
        task: _eval([*args, "--hf-model", str(moe["hf"])], root / f"hf-{task}.json")
        for task, args in tasks.items()
    }
    for task, args in tasks.items():  # the EP checkpoint in one process (its EP files merged)
        got = _eval([*args, "--ckpt", str(moe["ck-ep2"])], root / f"one-{task}.json")
        for key in ("adjusted_ppl", "token_ppl") if task == "wiki" else ("accuracy", "ppl"):
            assert got["metrics"][key] == pytest.approx(want[task]["metrics"][key], rel=1e-6), (task, key)
        assert got["model"]["fingerprint"] == want["wiki"]["model"]["fingerprint"]
    for name, proc in procs.items():
        output, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, output[-3000:]
        task, _, _, layout = RUNS[name][:4]
        got = json.loads((root / f"{name}.json").read_text())
        assert got["details"]["layout"] == layout
        assert (
            got["model"]["fingerprint"] == want["wiki"]["model"]["fingerprint"]
        )  # joined from the ranks' reads
        for key in ("adjusted_ppl", "token_ppl") if task == "wiki" else ("accuracy", "ppl"):
            assert got["metrics"][key] == pytest.approx(want[task]["metrics"][key], rel=1e-6), (name, key)
        if task == "wiki":
            assert got["metrics"]["windows"] % 2 == 1  # uneven split over 2 replicas: padding rows needed


@pytest.mark.slow
def test_harness_ep2_equals_one_process(moe: dict[str, Path]) -> None:
    from lm_eval import simple_evaluate

    import mlm_eval.harness.backend  # noqa: F401  registers --model mlm
    from tests.harness_fixtures import write_tasks
    from tests.test_harness_parity import assert_same

    tasks = write_tasks(moe["root"] / "tasks")
    one = simple_evaluate(model="mlm", model_args=f"ckpt={moe['ck']}", tasks=list(LOGLIKELIHOOD_TASKS),
                          task_manager=task_manager(tasks), device="cpu", batch_size=4,
                          log_samples=True)  # fmt: skip
    assert one is not None
    mine = {"results": one["results"],
            "resps": {t: [s["resps"] for s in sorted(one["samples"][t], key=lambda s: s["doc_id"])]
                      for t in LOGLIKELIHOOD_TASKS}}  # fmt: skip
    out = moe["root"] / "harness-ep2"
    argv = ["--model", "mlm", "--model_args", f"ckpt={moe['ck']},ep=2", "--tasks", ",".join(LOGLIKELIHOOD_TASKS),
            "--include_path", str(tasks), "--batch_size", "4", "--output_path", str(out), "--log_samples"]  # fmt: skip
    proc = launch(2, "mlm_eval.harness", argv, env={"HF_DATASETS_OFFLINE": "1"}, preload=LM_EVAL_INDEX)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (results_file,) = out.rglob("results_*.json")
    results = json.loads(results_file.read_text())["results"]
    resps = {}
    for task in LOGLIKELIHOOD_TASKS:
        (samples,) = out.rglob(f"samples_{task}_*.jsonl")
        rows = sorted(
            (json.loads(line) for line in samples.read_text().splitlines()), key=lambda r: r["doc_id"]
        )
        resps[task] = [r["resps"] for r in rows]
    assert_same({"results": results, "resps": resps}, mine, rel=1e-6, tasks=LOGLIKELIHOOD_TASKS)


def _harness_one(model: str, model_args: str, tasks: Path) -> dict[str, Any]:
    """All four local tasks in this process: results and each task's responses by doc_id."""
    from lm_eval import simple_evaluate

    import mlm_eval.harness.backend  # noqa: F401  registers --model mlm
    from tests.harness_fixtures import TASK_NAMES

    out = simple_evaluate(model=model, model_args=model_args, tasks=list(TASK_NAMES),
                          task_manager=task_manager(tasks), device="cpu", batch_size=4,
                          log_samples=True)  # fmt: skip
    assert out is not None
    resps = {
        t: [s["resps"] for s in sorted(out["samples"][t], key=lambda s: s["doc_id"])] for t in TASK_NAMES
    }
    return {"results": out["results"], "resps": resps}


def _harness_torchrun(nproc: int, model_args: str, tasks: Path, out: Path) -> dict[str, Any]:
    """All four local tasks with ``--model mlm`` under torchrun, read back from the harness's files."""
    from tests.harness_fixtures import TASK_NAMES

    argv = ["--model", "mlm", "--model_args", model_args, "--tasks", ",".join(TASK_NAMES), "--include_path",
            str(tasks), "--batch_size", "4", "--output_path", str(out), "--log_samples"]  # fmt: skip
    proc = launch(nproc, "mlm_eval.harness", argv, env={"HF_DATASETS_OFFLINE": "1"}, preload=LM_EVAL_INDEX)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (results_file,) = out.rglob("results_*.json")
    resps = {}
    for task in TASK_NAMES:
        (samples,) = out.rglob(f"samples_{task}_*.jsonl")
        rows = sorted((json.loads(x) for x in samples.read_text().splitlines()), key=lambda r: r["doc_id"])
        resps[task] = [r["resps"] for r in rows]
    return {"results": json.loads(results_file.read_text())["results"], "resps": resps}


@pytest.mark.slow
def test_harness_on_ep_checkpoint_equals_hf_backend(moe: dict[str, Path]) -> None:
    """``--model mlm`` on the EP checkpoint, one process and ``ep=2``, equals ``--model hf`` on the
    original on all four tasks; ``generate_until``'s 11 prompts split 6 / 5 over the replicas (one
    pads, both generate in lockstep)."""
    from tests.harness_fixtures import write_tasks
    from tests.test_harness_parity import _numbers, assert_same

    tasks = write_tasks(moe["root"] / "tasks-all", docs=11)  # 11 prompts: 6 / 5 over two replicas
    ep2 = _harness_torchrun(2, f"ckpt={moe['ck-ep2']},ep=2", tasks, moe["root"] / "harness-ep2-all")
    hf = _harness_one("hf", f"pretrained={moe['hf']},dtype=float32", tasks)
    one = _harness_one("mlm", f"ckpt={moe['ck-ep2']}", tasks)
    assert_same(one, hf, rel=1e-6)
    assert_same(ep2, hf, rel=1e-6)
    assert any(text.strip() for text in _numbers(ep2["resps"]["gen_local"]))  # not all empty


@pytest.mark.slow
def test_mlm_generate_ep2_equals_hf_model_and_one_process(
    moe: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """``mlm-generate --ep 2 --json`` (KV cache, greedy) on the EP checkpoint: three prompts of
    different lengths over two replicas, token for token as ``--hf-model`` and one process."""
    from mlm_eval.generation.cli import main as generate_main

    prompts = moe["root"] / "prompts.jsonl"
    texts = ["the quick brown fox", "It was", "Once upon a time, in a land far away, there lived"]
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    flags = ["--prompts", str(prompts), "--max-new-tokens", "8", "--json"]
    proc = subprocess.run(launch_command(2, "mlm_eval.generation.cli", ["--ckpt", str(moe["ck-ep2"]), "--ep", "2",
                                                                          *flags]),
                          env=torchrun_env(), capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    ep2 = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    outs = {}
    for source in (["--hf-model", str(moe["hf"])], ["--ckpt", str(moe["ck-ep2"])]):
        capsys.readouterr()
        assert generate_main([*source, *flags]) == 0
        outs[source[0]] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["tokens"] for r in ep2] == [r["tokens"] for r in outs["--hf-model"]]
    assert ep2 == outs["--ckpt"]
    assert all(r["tokens"] for r in ep2)


def _refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        eval_main(argv)
    assert exc.value.code == 2


def test_ep_needs_processes(moe: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    _refused([*WIKI, "--ckpt", str(moe["ck"]), "--ep", "2", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "error: --expert-model-parallel-size 2 needs 2 processes: launch with torchrun --nproc-per-node 2"
    ]


def test_world_not_divisible_by_ep(
    moe: dict[str, Path], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "3")  # refused before any process group is made
    _refused([*WIKI, "--ckpt", str(moe["ck"]), "--ep", "2", "--no-progress"])
    assert "is not divisible by --expert-tensor-parallel-size 1 x --expert-model-parallel-size 2" in (
        capsys.readouterr().err
    )


def _refusal(ckpt: Path) -> str:
    proc = subprocess.run(launch_command(2, "mlm_eval.cli", [*WIKI, "--ckpt", str(ckpt), "--ep", "2", "--no-progress"]),
                          env=torchrun_env(), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode != 0
    assert "/mlm_eval/" not in proc.stderr  # no frame of ours: one line (torchrun adds its own report)
    return proc.stderr


@pytest.mark.slow
def test_ep_refused_on_dense_and_indivisible_experts(
    moe: dict[str, Path], trained_gpt: dict[str, str], tmp_path: Path
) -> None:
    _, odd = _convert(tmp_path, num_experts=3)
    assert "--num-experts 3 is not divisible by --expert-model-parallel-size 2" in _refusal(odd)
    assert "--expert-model-parallel-size 2 needs a mixture-of-experts model" in _refusal(
        Path(trained_gpt["ckpt"])
    )
