"""Pipeline (and TP x PP) training steps equal one process: loss and every gradient."""

from __future__ import annotations

import pytest
import torch

from pretrain.models.sharding import gather_full_state_dict, load_full_state_dict
from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.state import ParallelState
from pretrain.pipeline.embedding_sync import allreduce_embedding_grads
from pretrain.pipeline.partition import build_model_chunks
from pretrain.pipeline.schedules import forward_backward
from tests.distributed import run_distributed
from tests.gpt_fixtures import batch, full_weights, single_process_reference, tiny_config

TOL = {"rtol": 1e-5, "atol": 1e-6}


def _microbatches(data: dict[str, torch.Tensor], m: int) -> list[dict[str, torch.Tensor]]:
    return [dict(zip(data, parts)) for parts in zip(*(t.chunk(m) for t in data.values()))]


def _pp_worker(
    rank: int, world: int, cfg, weights, data, tp: int, pp: int, vp: int, m: int, forward_only: bool
):
    ps = ParallelState.from_distributed(ParallelConfig(tp=tp, pp=pp, vp=vp), seed=0)
    chunks = build_model_chunks(cfg, ps)
    for chunk in chunks:
        load_full_state_dict(chunk, weights)
    total = data["loss_mask"].sum()

    def loss_fn(losses: torch.Tensor, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        return (losses * mb["loss_mask"]).sum() / total

    losses, per_token = forward_backward(
        chunks=chunks, ps=ps, microbatches=_microbatches(data, m), loss_fn=loss_fn,
        forward_only=forward_only, finalize_grads=lambda: allreduce_embedding_grads(chunks, ps),
        collect_outputs=True,
    )  # fmt: skip
    grads: dict[str, torch.Tensor] = {}
    if not forward_only:
        for chunk in chunks:
            grads.update(gather_full_state_dict(chunk, grads=True))
    return {
        "last": ps.is_last_stage,
        "loss": torch.stack(losses).sum() if losses else torch.zeros(()),
        "per_token": torch.cat(per_token) if per_token else torch.zeros(0),
        "grads": grads,
    }


LAYOUTS = [  # (tp, pp, vp, microbatches)
    (1, 2, 1, 4),
    (1, 4, 1, 4),
    (1, 2, 2, 4),
    (1, 4, 2, 4),
    (2, 2, 1, 4),
    (1, 2, 1, 1),
]


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "pp", "vp", "m"), LAYOUTS)
def test_pipeline_step_equals_single_process(tp: int, pp: int, vp: int, m: int) -> None:
    cfg = tiny_config(num_layers=8, num_attention_heads=4)
    weights, data = full_weights(cfg), batch(cfg, b=8, s=8)
    _, ref_loss, ref_grads = single_process_reference(cfg, weights, data)
    results = run_distributed(_pp_worker, tp * pp, cfg, weights, data, tp, pp, vp, m, False)
    merged: dict[str, torch.Tensor] = {}
    for r in results:
        merged.update(r["grads"])
        if r["last"]:
            torch.testing.assert_close(r["loss"], ref_loss, **TOL)
    assert set(merged) == set(ref_grads)
    for name, g in ref_grads.items():
        for r in results:  # every rank holding a tensor (incl. the tied head copy) has the full gradient
            if name in r["grads"]:
                torch.testing.assert_close(r["grads"][name], g, **TOL, msg=lambda s, n=name: f"{n}: {s}")


@pytest.mark.slow
@pytest.mark.parametrize(("pp", "vp"), [(2, 1), (2, 2)])
def test_forward_only_per_token_losses(pp: int, vp: int) -> None:
    from pretrain.models.gpt import GPTModel

    cfg = tiny_config(num_layers=4, num_attention_heads=4)
    weights, data = full_weights(cfg), batch(cfg, b=6, s=8)
    ref = GPTModel(cfg, ParallelState.single())
    load_full_state_dict(ref, weights)
    with torch.no_grad():
        ref_tokens = ref(data["tokens"], labels=data["labels"])
    results = run_distributed(_pp_worker, pp, cfg, weights, data, 1, pp, vp, 3, True)
    last = [r for r in results if r["last"]]
    assert len(last) == 1
    torch.testing.assert_close(last[0]["per_token"], ref_tokens, **TOL)
