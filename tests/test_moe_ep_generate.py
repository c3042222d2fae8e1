"""KV-cache generation with the experts split over ranks (EP 2; TP 2 x EP 2 with ETP 1).

A tiny random Qwen2-MoE (6 experts, a dense layer, a gated shared expert) built from transformers:

* replicas generating different prompts that finish at different steps (one stops after its first
  token, the other runs on) do not hang: every expert all-to-all stays paired, and each row's
  greedy tokens equal transformers' ``generate`` on the original;
* :meth:`HarnessEngine.generate` with more prompts than divide evenly over the replicas (one
  replica pads with rows marked done), or one prompt (a replica with padding only), equals
  transformers;
* TP 2 x EP 2 with ETP 1 on one prompt per replica: the TP rank whose share of a one-token decode
  step is empty still takes part in every all-to-all; PP 2 x EP 2 too.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pretrain.inference.generate import GenerationConfig, generate
from pretrain.models.gpt import GPTModel
from pretrain.models.sharding import load_full_state_dict
from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.state import ParallelState
from pretrain.pipeline.partition import build_model_chunks
from tests.distributed import run_distributed
from tests.moe_hf_fixtures import hf_model, import_state

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

PROMPTS = [[5, 17, 30, 2], [9], [44, 45, 46, 47, 48, 49, 50], [12, 13], [60, 61, 62]]
NEW = 10


@pytest.fixture(scope="module")
def moe() -> dict[str, Any]:
    hf = hf_model("qwen2_moe")
    cfg, full = import_state("qwen2_moe", hf)
    eos = int(hf.config.eos_token_id)
    want = []
    for prompt in PROMPTS:
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, pad_token_id=eos)
        new = ref[0, len(prompt) :].tolist()
        want.append(new[: new.index(eos)] if eos in new else new)
    return {"cfg": cfg, "full": full, "eos": eos, "want": want}


def _model(par: ParallelConfig, cfg: Any, full: dict[str, torch.Tensor]) -> GPTModel:
    (model,) = build_model_chunks(cfg, ParallelState.from_distributed(par, seed=0))
    assert isinstance(model, GPTModel)
    load_full_state_dict(model, full)
    return model.eval()


def _uneven_worker(
    rank: int, world: int, cfg: Any, full: dict[str, torch.Tensor], eos: int
) -> list[list[int]]:
    """Replica 0 generates prompts 0-1 and stops each after its first token; replica 1 generates
    prompts 2-4 to the end."""
    model = _model(ParallelConfig(ep=2), cfg, full)
    mine = PROMPTS[:2] if model.ps.dp_rank == 0 else PROMPTS[2:]
    stop = (lambda _row, _toks: True) if model.ps.dp_rank == 0 else None  # noqa: E731
    return generate(model, mine, GenerationConfig(max_new_tokens=NEW, eos_id=eos), stop=stop)


def test_replicas_finishing_at_different_steps_do_not_hang(moe: dict[str, Any]) -> None:
    got = run_distributed(_uneven_worker, 2, moe["cfg"], moe["full"], moe["eos"], timeout=120)
    want = moe["want"]
    assert got[0] == [w[:1] for w in want[:2]]
    assert got[1] == want[2:]
    assert len({len(w) for w in want[2:]}) > 1 or max(len(w) for w in want[2:]) > 1  # runs past replica 0


def _engine_worker(
    rank: int, world: int, par: ParallelConfig, cfg: Any, full: dict[str, torch.Tensor], eos: int, batch: int,
    n: int,
) -> list[list[int]]:  # fmt: skip
    from mlm_eval.harness.engine import BatchInvariantScorer, HarnessEngine

    model = _model(par, cfg, full)
    engine = HarnessEngine(model, BatchInvariantScorer(model), None, batch_size=batch)  # type: ignore[arg-type]
    return engine.generate(PROMPTS[:n], GenerationConfig(max_new_tokens=NEW, eos_id=eos))


@pytest.mark.parametrize(
    ("world", "par", "batch", "n"),
    [(2, ParallelConfig(ep=2), 2, 5), (2, ParallelConfig(ep=2), 1, 1), (4, ParallelConfig(tp=2, ep=2, etp=1), 1, 2),
     (4, ParallelConfig(pp=2, ep=2), 2, 5)],
    ids=["ep2-padded", "ep2-one-prompt", "tp2-ep2-etp1-empty-share", "pp2-ep2"],
)  # fmt: skip
def test_engine_generate_with_expert_parallelism_equals_transformers(
    moe: dict[str, Any], world: int, par: ParallelConfig, batch: int, n: int
) -> None:
    """5 prompts over 2 replicas (one pads a row); 1 prompt (one replica generates padding only);
    TP 2 x EP 2 ETP 1, one prompt per replica (decode steps leave TP rank 1 no tokens); PP 2 x EP 2
    (each stage's EP group pairs the replicas' stages)."""
    results = run_distributed(
        _engine_worker, world, par, moe["cfg"], moe["full"], moe["eos"], batch, n, timeout=180
    )
    for got in results:  # every rank holds every prompt's tokens
        assert got == moe["want"][:n]
