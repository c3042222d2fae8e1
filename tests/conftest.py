"""Session-wide fixtures: the tiny corpus, tokenizers, models and trained checkpoint are built once.

Every fixture here is session-scoped and read-only for the tests that use it (copy before
changing). Multi-process and browser tests are marked ``slow``; ``make test-fast`` skips them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.fresh_demo import FreshDemo, shared_demo
from tests.lm_eval_index import cache_dir

os.environ.setdefault("HF_HUB_OFFLINE", "1")
cache_dir()  # the run's directory for lm-eval's task index, made once (the xdist workers inherit it)


@pytest.fixture(scope="session")
def gpt_data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Tiny GPT-2 BPE tokenizer + the built-in corpus preprocessed: ``{"data", "vocab", "merges"}``."""
    from tests.train_fixtures import make_gpt_data

    return make_gpt_data(tmp_path_factory.mktemp("gptdata"))


@pytest.fixture(scope="session")
def trained_gpt(gpt_data: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """``gpt_data`` plus ``ckpt``: a 2-layer GPT trained 3 iterations (tp=1, pp=1) on it."""
    from pretrain.training.cli import main as pretrain_main
    from tests.train_fixtures import gpt_args

    ckpt = tmp_path_factory.mktemp("trained_gpt") / "ckpt"
    assert pretrain_main(gpt_args(gpt_data, **{"train-iters": 3, "save": ckpt, "num-layers": 2})) == 0
    return {**gpt_data, "ckpt": str(ckpt)}


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Hugging Face GPT-2 (64 positions) with its tiny BPE tokenizer."""
    from tests.eval_helpers import build_tiny_hf

    return build_tiny_hf(tmp_path_factory.mktemp("tiny-gpt2"))


@pytest.fixture(scope="session")
def tiny_gpt2_dir_160(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """As ``tiny_gpt2_dir`` with 160 positions (LAMBADA contexts fit without a cut)."""
    from tests.eval_helpers import build_tiny_hf

    return build_tiny_hf(tmp_path_factory.mktemp("tiny-gpt2-160"), n_positions=160)


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Hugging Face BERT (160 positions) whose WordPiece covers the built-in tasks."""
    from finetune.builtin import builtin_task_dir
    from tests.finetune_fixtures import FINETUNE_WORDS, make_tiny_hf_bert

    texts = [
        line.split("\t")[0] for line in (builtin_task_dir("sst2_tiny") / "train.tsv").read_text().splitlines()
    ]
    for name in ("squad_tiny", "squad2_tiny"):
        doc = json.loads((builtin_task_dir(name) / "train.json").read_text())
        texts += [
            p["context"] + " " + q["question"] for a in doc["data"] for p in a["paragraphs"] for q in p["qas"]
        ]
    texts += [p.read_text() for p in builtin_task_dir("race_tiny").rglob("*.txt")]
    root = tmp_path_factory.mktemp("bert") / "tiny"
    return make_tiny_hf_bert(root, texts + FINETUNE_WORDS, max_positions=160)


@pytest.fixture(scope="session")
def fresh_demo(tmp_path_factory: pytest.TempPathFactory) -> FreshDemo:
    """The demo, run once per test run and shared by the workers: :func:`tests.fresh_demo.shared_demo`."""
    return shared_demo(tmp_path_factory.getbasetemp())
