"""A Llama-style model (RMSNorm, SwiGLU, RoPE, GQA 4 q / 2 kv heads, untied output, no biases)
through mlm-pretrain: save and resume equals the uninterrupted run bitwise (losses and weights),
and a tp2 checkpoint resharded with its optimizer state to tp1 pp2 resumes with the same losses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pretrain.checkpoint.opener import load_canonical
from pretrain.training.cli import main as pretrain_main
from tests.distributed import launch
from tests.train_fixtures import gpt_args
from tools.convert_cli import main as convert_main

LLAMA = {
    "normalization": "RMSNorm", "swiglu": True, "position-embedding-type": "rope", "group-query-attention": True,
    "num-query-groups": 2, "untie-embeddings-and-output-weights": True, "disable-bias-linear": True,
    "ffn-hidden-size": 48,
}  # fmt: skip


@pytest.fixture(scope="module")
def data(gpt_data: dict[str, str]) -> dict[str, str]:
    return gpt_data


def _losses(path: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]


def _args(data: dict[str, str], **kw: object) -> list[str]:
    return gpt_args(data, **LLAMA, **kw)  # type: ignore[arg-type]


def test_llama_resume_equals_the_uninterrupted_run_bitwise(data: dict[str, str], tmp_path: Path) -> None:
    common = {"hidden-dropout": 0.1, "attention-dropout": 0.1, "lr-decay-style": "cosine", "lr-warmup-iters": 2,
              "lr-decay-iters": 6}  # fmt: skip
    full = _args(
        data, **common, **{"train-iters": 6, "save": tmp_path / "full", "log-json": tmp_path / "full.jsonl"}
    )
    assert pretrain_main(full) == 0
    first = _args(
        data, **common, **{"train-iters": 3, "save": tmp_path / "ck", "log-json": tmp_path / "a.jsonl"}
    )
    assert pretrain_main(first) == 0
    resumed = _args(data, **common, **{"train-iters": 6, "load": tmp_path / "ck", "save": tmp_path / "ck",
                                       "log-json": tmp_path / "b.jsonl"})  # fmt: skip
    assert pretrain_main(resumed) == 0
    a, b, ref = _losses(tmp_path / "a.jsonl"), _losses(tmp_path / "b.jsonl"), _losses(tmp_path / "full.jsonl")
    assert (len(a), len(b)) == (3, 3)
    assert a + b == ref  # bitwise: the same floats
    assert ref[0] > ref[-1]  # it learns
    want, spec, _ = load_canonical(tmp_path / "full", iteration=6)
    got, _, _ = load_canonical(tmp_path / "ck", iteration=6)
    assert spec.cfg.swiglu and spec.cfg.num_query_groups == 2 and spec.cfg.untie_embeddings_and_output_weights
    assert set(got) == set(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name


@pytest.mark.slow
def test_tp2_optimizer_state_resharded_to_tp1_pp2_resumes(data: dict[str, str], tmp_path: Path) -> None:
    flags = {"adam-eps": 1e-5, "train-iters": 5, "micro-batch-size": 2, "global-batch-size": 4}
    ref = _args(data, **flags, **{"tp": 2, "save": tmp_path / "a", "save-interval": 3,
                                  "log-json": tmp_path / "a.jsonl"})  # fmt: skip
    proc = launch(2, "pretrain.training.cli", ref)
    assert proc.returncode == 0, proc.stderr[-3000:]
    argv = ["reshard", "--load", str(tmp_path / "a"), "--save", str(tmp_path / "b"), "--target-tp", "1",
            "--target-pp", "2", "--iteration", "3", "--with-optimizer"]  # fmt: skip
    assert convert_main(argv) == 0
    # Step 4's loss checks the resharded weights (SwiGLU/GQA rows); step 5's the optimizer state.
    resumed = _args(data, **flags, **{"pp": 2, "use-distributed-optimizer": True, "load": tmp_path / "b",
                                      "save": tmp_path / "c", "log-json": tmp_path / "c.jsonl"})  # fmt: skip
    proc = launch(2, "pretrain.training.cli", resumed)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, c = _losses(tmp_path / "a.jsonl"), _losses(tmp_path / "c.jsonl")
    assert (len(a), len(c)) == (5, 2)
    torch.testing.assert_close(torch.tensor(c), torch.tensor(a[3:]), rtol=1e-5, atol=0)
    want, _, _ = load_canonical(tmp_path / "a", iteration=5)
    got, _, info = load_canonical(tmp_path / "c", iteration=5)
    assert (info.tp, info.pp) == (1, 2) and set(got) == set(want)
    for name, t in want.items():
        torch.testing.assert_close(got[name], t, rtol=1e-4, atol=1e-6, msg=f"{name} differs")
