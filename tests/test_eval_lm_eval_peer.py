"""Peer check: lm-evaluation-harness, offline on local task files, equals ``mlm-eval``.

Runs only where the optional ``lm-eval`` package (and ``accelerate``, which its ``hf`` model
needs) is installed. The harness evaluates the tiny Hugging Face model on local copies of its
``wikitext`` and ``lambada_openai`` task definitions (``dataset_path: json`` on files written
here); ``mlm-eval wikitext103 --method lm-eval`` and ``mlm-eval lambada`` must give its numbers.
The LAMBADA file mixes the samples with examples ending in the model's own greedy next word, so
the accuracy is neither 0 nor 1.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from mlm_eval.builtin import builtin_path
from mlm_eval.cli import main
from mlm_eval.tasks.wikitext import split_wikitext_documents
from tests.eval_helpers import build_tiny_hf, load_tiny
from tests.harness_fixtures import LAMBADA_YAML, WIKI_YAML
from tests.lm_eval_index import task_manager

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def _lambada_texts(model_dir: Path) -> list[str]:
    model, tokenizer = load_tiny(model_dir)
    texts = [json.loads(x)["text"] for x in builtin_path("lambada_sample.jsonl").read_text().splitlines()]
    out = []
    for text in texts[:25]:
        context = text[: text.rfind(text.split()[-1])].strip()
        ids = tokenizer.encode(context)[-model.config.n_positions :]
        with torch.no_grad():
            word = tokenizer.decode([int(model(torch.tensor([ids])).logits[0, -1].argmax())])
        if word.startswith(" ") and word[1:].isalpha():
            out.append(context + word)
    return out + texts[25:]


def _write_tasks(root: Path, model_dir: Path) -> Path:
    tasks = root / "tasks"
    tasks.mkdir()
    raw = builtin_path("wikitext_sample.tokens").read_text(encoding="utf-8")
    pages = root / "wiki.jsonl"
    pages.write_text("".join(json.dumps({"page": p}) + "\n" for p in split_wikitext_documents(raw)))
    lambada = root / "lambada.jsonl"
    lambada.write_text("".join(json.dumps({"text": t}) + "\n" for t in _lambada_texts(model_dir)))
    shutil.copy(Path(lm_eval.__file__).parent / "tasks/wikitext/preprocess_wikitext.py", tasks)
    (tasks / "wiki_local.yaml").write_text(WIKI_YAML.format(data=pages))
    (tasks / "lambada_local.yaml").write_text(LAMBADA_YAML.format(data=lambada))
    return tasks


def _ours(model_dir: Path, root: Path, argv: list[str]) -> dict[str, Any]:
    out = root / f"{argv[0]}.json"
    assert main([*argv, "--hf-model", str(model_dir), "--no-progress", "--out", str(out)]) == 0
    return json.loads(out.read_text())["metrics"]  # type: ignore[no-any-return]


@pytest.mark.slow  # > 10 s
def test_lm_eval_harness_equals_mlm_eval(tmp_path: Path) -> None:
    from lm_eval import simple_evaluate

    model_dir = build_tiny_hf(tmp_path / "model")
    tasks = _write_tasks(tmp_path, model_dir)
    results = simple_evaluate(
        model="hf",
        model_args=f"pretrained={model_dir},dtype=float32,max_length=64",
        tasks=["wiki_local", "lambada_local"],
        task_manager=task_manager(tasks),
        device="cpu",
        batch_size=4,
    )["results"]
    wiki = _ours(model_dir, tmp_path, ["wikitext103", "--data", "builtin:wikitext_sample.tokens",
                                       "--method", "lm-eval", "--seq-length", "64"])  # fmt: skip
    for key in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
        assert wiki[key] == pytest.approx(results["wiki_local"][f"{key},none"], rel=1e-6), key
    lam = _ours(model_dir, tmp_path, ["lambada", "--data", str(tmp_path / "lambada.jsonl")])
    peer = results["lambada_local"]
    assert 0 < lam["accuracy"] < 1
    assert lam["accuracy"] == pytest.approx(peer["acc,none"], abs=1e-12)
    assert lam["ppl"] == pytest.approx(peer["perplexity,none"], rel=1e-6)
