"""mlm-eval on Llama-style models: a Hugging Face directory (``--hf-model``) and its converted
checkpoint (``--ckpt`` at tp1 and tp2 pp2, and under torchrun at tp2) give the same WikiText
(paper and lm-eval methods) and LAMBADA numbers, and BOS follows the tokenizer's convention.

Two tokenizers: a Llama SentencePiece model (as Hugging Face's ``LlamaTokenizer``: BOS before
every document) and a Qwen2-style ``tokenizer.json`` byte-level BPE (no BOS, as GPT-2).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from mlm_eval.builtin import builtin_path
from mlm_eval.cli import main as eval_main
from tests.distributed import launch_command, torchrun_env
from tests.llama_fixtures import (
    qwen_style_bpe_tokenizer,
    save_llama_with_tokenizer,
    train_llama_sentencepiece,
)
from tools.convert_cli import main as convert_main

pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

WIKI = ["--data", "builtin:wikitext_sample.tokens", "--seq-length", "32", "--overlap", "8"]
TASKS = {  # name -> argv before the model flags
    "wiki-paper": ["wikitext103", *WIKI, "--method", "paper"],
    "wiki-lm-eval": ["wikitext103", *WIKI, "--method", "lm-eval"],
    "lambada": ["lambada", "--data", "builtin:lambada_sample.jsonl"],
}
KEYS = {"wiki-paper": ("adjusted_ppl", "token_ppl"), "wiki-lm-eval": ("word_perplexity", "byte_perplexity"),
        "lambada": ("ppl", "accuracy")}  # fmt: skip


def _tokenizer(kind: str, root: Path) -> Any:
    if kind == "sentencepiece":
        from tools.hf_sentencepiece import llama_tokenizer_from_sentencepiece

        model = train_llama_sentencepiece(root / "llama.model")
        return llama_tokenizer_from_sentencepiece(str(model), add_bos=True)
    return qwen_style_bpe_tokenizer()


@pytest.fixture(scope="module", params=["sentencepiece", "bpe"])
def models(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp(f"llama-eval-{request.param}")
    tok = _tokenizer(request.param, root)
    model = save_llama_with_tokenizer(root / "hf", tok, max_position_embeddings=256)
    for name, layout in (("tp1", []), ("tp2pp2", ["--tp", "2", "--pp", "2"])):
        argv = ["from-hf", "--load", str(root / "hf"), "--save", str(root / name), *layout]
        assert convert_main(argv) == 0
    return {"root": root, "kind": request.param, "tokenizer": tok, "model": model}


def _eval(models: dict[str, Any], task: str, source: list[str], name: str) -> dict[str, Any]:
    out = models["root"] / f"{task}-{name}.json"
    assert eval_main([*TASKS[task], *source, "--out", str(out), "--no-progress"]) == 0
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def _sources(models: dict[str, Any]) -> dict[str, list[str]]:
    root = models["root"]
    return {"hf": ["--hf-model", str(root / "hf")], "tp1": ["--ckpt", str(root / "tp1")],
            "tp2pp2": ["--ckpt", str(root / "tp2pp2")]}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("task", sorted(TASKS))
def test_hf_model_and_converted_checkpoints_give_the_same_numbers(models: dict[str, Any], task: str) -> None:
    records = {name: _eval(models, task, src, name) for name, src in _sources(models).items()}
    want = records["hf"]["metrics"]
    for name, record in records.items():
        for key in KEYS[task]:
            assert record["metrics"][key] == pytest.approx(want[key], rel=1e-6), (name, key)
        if task == "lambada":
            assert record["metrics"]["correct"] == want["correct"], name
        llama_bos = models["kind"] == "sentencepiece"
        bos = record["details"]["bos"]
        assert bos["prepended"] is llama_bos, name
        assert bos["prefix_token_id"] == (1 if llama_bos else 0), name  # <s>; else <|endoftext|> (eos)
    fingerprints = {r["model"]["fingerprint"] for r in records.values()}
    assert len(fingerprints) == 1


def test_llama_tokenizer_puts_bos_before_the_text_it_scores(models: dict[str, Any], tmp_path: Path) -> None:
    """One LAMBADA example: the checkpoint's ppl is exp(NLL of the target after [BOS] + context)
    (Llama) or after the context alone (Qwen2-style), computed here with transformers."""
    lines = builtin_path("lambada_sample.jsonl").read_text().splitlines()
    text = min((json.loads(line)["text"] for line in lines), key=len)  # fits the 256 positions
    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps({"text": text}) + "\n")
    out = tmp_path / "one.json"
    argv = ["lambada", "--data", str(data), "--ckpt", str(models["root"] / "tp1"), "--out", str(out)]
    assert eval_main([*argv, "--no-progress"]) == 0
    metrics = json.loads(out.read_text())["metrics"]
    assert metrics["truncated"] == 0
    got = metrics["ppl"]
    tok, model = models["tokenizer"], models["model"]
    word = text.split()[-1]
    context = tok.encode(text[: text.rfind(word)].strip(), add_special_tokens=False)
    target = tok.encode(" " + word, add_special_tokens=False)
    prefix = [tok.bos_token_id] if models["kind"] == "sentencepiece" else []
    ids = torch.tensor([prefix + context + target])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].double(), dim=-1)
    nll = -sum(float(logp[len(ids[0]) - len(target) - 1 + j, t]) for j, t in enumerate(target))
    assert got == pytest.approx(float(torch.tensor(nll).exp()), rel=1e-5)


def test_wikitext_paper_method_scores_every_original_token_after_bos(models: dict[str, Any]) -> None:
    record = _eval(models, "wiki-paper", ["--ckpt", str(models["root"] / "tp1")], "count")
    m = record["metrics"]
    assert m["scored_targets"] == m["num_tokens"] - 1
    detok = models["tokenizer"].encode  # num_tokens counts the BOS the Llama tokenizer puts first
    from mlm_eval.tasks.detokenize import wikitext_detokenize
    from mlm_eval.tasks.wikitext import read_wikitext

    raw = read_wikitext(builtin_path("wikitext_sample.tokens"))
    n = len(detok(wikitext_detokenize(raw), add_special_tokens=False))
    assert m["num_tokens"] == n + (1 if models["kind"] == "sentencepiece" else 0)


@pytest.mark.slow
def test_torchrun_tp2_equals_one_process(models: dict[str, Any]) -> None:
    import subprocess

    root = models["root"]
    procs = {}
    for task in ("wiki-paper", "lambada"):
        argv = [*TASKS[task], "--ckpt", str(root / "tp1"), "--tensor-model-parallel-size", "2", "--no-progress",
                "--out", str(root / f"{task}-torchrun.json")]  # fmt: skip
        procs[task] = subprocess.Popen(launch_command(2, "mlm_eval.cli", argv), env=torchrun_env(),
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    for task, proc in procs.items():
        log, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, log[-3000:]
        want = _eval(models, task, ["--hf-model", str(root / "hf")], "hf-ref")
        record = json.loads((root / f"{task}-torchrun.json").read_text())
        assert record["details"]["layout"] == "tp2-pp1-dp1"
        assert record["details"]["bos"] == want["details"]["bos"]
        for key in KEYS[task]:
            assert record["metrics"][key] == pytest.approx(want["metrics"][key], rel=1e-6), key
