"""mlm-eval under torchrun: one checkpoint gives the same numbers at tp1, tp2, pp2 and dp2.

Four ``python -m torch.distributed.run`` launches run side by side (gloo, CPU): WikiText at
TP=2 and at PP=2 x DP=2, LAMBADA at PP=2 and at TP=2 x DP=2; each is compared with the same
task evaluated in this process (TP=1). The LAMBADA file mixes the sample examples with examples
whose last word is the model's own greedy prediction, so the correct count is not trivially 0.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from mlm_eval.builtin import builtin_path
from mlm_eval.cli import main as eval_main
from mlm_eval.scoring.megatron import load_megatron_gpt
from pretrain.tokenizer.factory import TokenizerConfig
from tests.distributed import launch_command, torchrun_env

WIKI = ["wikitext103", "--data", "builtin:wikitext_sample.tokens", "--seq-length", "32", "--overlap", "8"]
LAYOUTS = {  # name -> (task, processes, parallel flags, the layout the result records)
    "wiki-tp2": ("wiki", 2, ["--tensor-model-parallel-size", "2"], "tp2-pp1-dp1"),
    "wiki-pp2-dp2": ("wiki", 4, ["--pipeline-model-parallel-size", "2"], "tp1-pp2-dp2"),
    "lambada-pp2": ("lambada", 2, ["--pipeline-model-parallel-size", "2"], "tp1-pp2-dp1"),
    "lambada-tp2-dp2": ("lambada", 4, ["--tensor-model-parallel-size", "2"], "tp2-pp1-dp2"),
}


def _greedy_examples(ckpt: Path, vocab: str, merges: str) -> list[str]:
    """Sample texts whose last word is replaced by the model's argmax next token (when a word)."""
    tok = TokenizerConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    scorer, encoder, _ = load_megatron_gpt(str(ckpt), tokenizer_cfg=tok, batch_size=1)
    model, tokenizer = scorer.model, encoder.tokenizer
    texts = [
        json.loads(line)["text"] for line in builtin_path("lambada_sample.jsonl").read_text().splitlines()
    ]
    out = []
    for text in texts[:30]:
        context = text[: text.rfind(text.split()[-1])].strip()
        with torch.inference_mode():
            ids = encoder.encode(context)[-scorer.max_length :]  # lambada cuts the context so, too
            best = int(model.full_logits(model(torch.tensor([ids])))[0, -1].argmax())
        word = tokenizer.detokenize([best])
        if word.startswith(" ") and word[1:].isalpha():
            out.append(context + word)
    return out + texts[30:]


@pytest.fixture(scope="module")
def trained(trained_gpt: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("evalpar")
    data, ckpt = trained_gpt, Path(trained_gpt["ckpt"])
    lambada = root / "lambada.jsonl"
    examples = _greedy_examples(ckpt, data["vocab"], data["merges"])
    lambada.write_text("".join(json.dumps({"text": t}) + "\n" for t in examples))
    return {**data, "ckpt": str(ckpt), "root": str(root), "lambada": str(lambada)}


def _task_args(trained: dict[str, str], task: str) -> list[str]:
    base = WIKI if task == "wiki" else ["lambada", "--data", trained["lambada"]]
    return [*base, "--ckpt", trained["ckpt"], "--no-progress"]


def _launch(trained: dict[str, str], name: str) -> subprocess.Popen[str]:
    task, nproc, flags, _ = LAYOUTS[name]
    out = Path(trained["root"]) / f"{name}.json"
    cmd = launch_command(nproc, "mlm_eval.cli", [*_task_args(trained, task), *flags, "--out", str(out)])
    return subprocess.Popen(
        cmd, env=torchrun_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


@pytest.mark.slow
def test_layouts_give_the_same_numbers(trained: dict[str, str]) -> None:
    procs = {name: _launch(trained, name) for name in LAYOUTS}  # started first: they run while we do tp1
    single = {}
    for task in ("wiki", "lambada"):
        out = Path(trained["root"]) / f"{task}-tp1.json"
        assert eval_main([*_task_args(trained, task), "--out", str(out)]) == 0
        single[task] = json.loads(out.read_text())
    for name, proc in procs.items():
        log, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, f"{name} failed:\n{log[-3000:]}"
    wiki, lam = single["wiki"]["metrics"], single["lambada"]["metrics"]
    assert wiki["scored_targets"] == wiki["num_tokens"] - 1
    assert 0 < lam["correct"] < lam["count"], "the fixture should mix right and wrong examples"
    for name, (task, _, _, layout) in LAYOUTS.items():
        record = json.loads((Path(trained["root"]) / f"{name}.json").read_text())
        got = record["metrics"]
        assert record["details"]["layout"] == layout, name
        if task == "wiki":
            assert got["adjusted_ppl"] == pytest.approx(wiki["adjusted_ppl"], rel=1e-6), name
            assert got["token_ppl"] == pytest.approx(wiki["token_ppl"], rel=1e-6), name
            assert (got["scored_targets"], got["windows"]) == (wiki["scored_targets"], wiki["windows"]), name
        else:
            assert (got["correct"], got["count"]) == (lam["correct"], lam["count"]), name
            assert got["ppl"] == pytest.approx(lam["ppl"], rel=1e-6), name
            assert got["target_tokens"] == lam["target_tokens"], name


def test_bf16_is_close_to_fp32(trained: dict[str, str]) -> None:
    outs = {}
    for dtype in ("fp32", "bf16"):
        out = Path(trained["root"]) / f"wiki-{dtype}.json"
        assert (
            eval_main([*_task_args(trained, "wiki"), "--dtype", dtype, "--limit", "40", "--out", str(out)])
            == 0
        )
        outs[dtype] = json.loads(out.read_text())
    assert outs["bf16"]["details"]["dtype"] == "bfloat16"
    fp32, bf16 = outs["fp32"]["metrics"]["token_ppl"], outs["bf16"]["metrics"]["token_ppl"]
    assert bf16 == pytest.approx(fp32, rel=0.02) and bf16 != fp32


def test_parallel_flags_need_torchrun(trained: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        eval_main([*_task_args(trained, "wiki"), "--tensor-model-parallel-size", "2"])
    assert exc.value.code == 2 and "torchrun" in capsys.readouterr().err
