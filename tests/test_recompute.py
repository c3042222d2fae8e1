"""Activation recomputation (``--recompute-granularity selective|full``, ``--recompute-method
uniform|block``, ``--recompute-num-layers``) equals no recomputation on loss and every gradient,
with dropout on (the replayed forward draws the same masks), and really keeps fewer bytes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from benchmarks.saved_bytes import SavedBytes
from pretrain.config import ModelConfig
from pretrain.models.bert import BertModel, bert_forward_step
from pretrain.models.gpt import GPTModel
from pretrain.models.recompute import layer_groups
from pretrain.models.sharding import gather_full_state_dict, load_full_state_dict
from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.state import ParallelState
from pretrain.tensor_parallel.cross_entropy import masked_mean
from pretrain.tensor_parallel.sequence_parallel import allreduce_sequence_parallel_grads
from pretrain.utils.errors import UserError
from tests import test_bert_model as bert
from tests.distributed import run_distributed
from tests.gpt_fixtures import batch, full_weights, tiny_config
from tests.llama_fixtures import llama_config
from tests.test_llama_parallel import llama_weights

DROPOUT = {"hidden_dropout": 0.1, "attention_dropout": 0.1}
MODES: dict[str, dict[str, object]] = {
    "selective": {"recompute_granularity": "selective"},
    "uniform-1": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    "uniform-3": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 3},
    "block-2": {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 2},
    "recompute-activations": {"recompute_activations": True},
}


def _case(family: str):
    if family == "gpt2":
        cfg = tiny_config(num_layers=4, **DROPOUT)
        return cfg, full_weights(cfg), batch(cfg, b=2, s=8)
    if family == "llama":
        cfg = llama_config(num_layers=4, **DROPOUT)
        return cfg, llama_weights(cfg), batch(cfg, b=2, s=8)
    cfg = bert.bert_config(post_layernorm=True, **DROPOUT)
    return cfg, bert.full_weights(cfg), bert.bert_batch(cfg, b=2, s=12)


def _step(
    cfg: ModelConfig, weights, data, ps: ParallelState, seed: int = 17
) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """Loss, full gradients and the bytes saved for backward of one seeded training step."""
    ps.seed(seed)
    bidirectional = cfg.bidirectional
    model = BertModel(cfg, ps) if bidirectional else GPTModel(cfg, ps)
    load_full_state_dict(model, weights)
    model.train()
    counter = SavedBytes(exclude=model.parameters())
    with counter.counting():
        if bidirectional:
            loss = bert._loss_fn(data)(bert_forward_step(model, data, None, True), data)
        else:
            loss = masked_mean(model(data["tokens"], labels=data["labels"]), data["loss_mask"])
    loss.backward()
    allreduce_sequence_parallel_grads([model], ps.tp_group)
    return loss.detach(), gather_full_state_dict(model, grads=True), counter.total


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_recompute_equals_no_recompute_with_dropout(family: str) -> None:
    cfg, weights, data = _case(family)
    ref_loss, ref_grads, ref_bytes = _step(cfg, weights, data, ParallelState.single())
    other_loss, _, _ = _step(cfg, weights, data, ParallelState.single(), seed=18)
    assert not torch.equal(other_loss, ref_loss), "dropout must be active for the check to mean anything"
    for mode, options in MODES.items():
        loss, grads, saved = _step(dataclasses.replace(cfg, **options), weights, data, ParallelState.single())
        assert torch.equal(loss, ref_loss), mode
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=0, atol=0, msg=f"{mode} {name}")
        assert saved < ref_bytes, (
            f"{mode}: {saved} bytes kept, no less than without recomputation ({ref_bytes})"
        )


def test_layer_groups_follow_megatron() -> None:
    cfg = tiny_config(num_layers=5)
    full = {"recompute_granularity": "full"}
    assert layer_groups(cfg, 5) == [(range(5), False)]
    assert layer_groups(dataclasses.replace(cfg, recompute_granularity="selective"), 5) == [(range(5), False)]
    uniform = dataclasses.replace(cfg, **full, recompute_method="uniform", recompute_num_layers=2)
    assert layer_groups(uniform, 5) == [(range(0, 2), True), (range(2, 4), True), (range(4, 5), True)]
    block = dataclasses.replace(cfg, **full, recompute_method="block", recompute_num_layers=2)
    assert layer_groups(block, 5) == [(range(0, 1), True), (range(1, 2), True), (range(2, 5), False)]
    assert layer_groups(block, 1) == [(range(0, 1), True)]  # a stage with fewer layers than n


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"recompute_granularity": "full"}, "needs --recompute-method and --recompute-num-layers"),
        ({"recompute_method": "block", "recompute_num_layers": 1}, "need --recompute-granularity full"),
        (
            {"recompute_granularity": "selective", "recompute_method": "uniform"},
            "need --recompute-granularity full",
        ),
        ({"recompute_granularity": "selective", "recompute_activations": True}, "exclude each other"),
        (
            {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 0},
            "positive",
        ),
        ({"recompute_granularity": "some"}, "--recompute-granularity must be full or selective"),
    ],
)
def test_bad_recompute_flags_are_one_line(options: dict[str, object], message: str) -> None:
    with pytest.raises(UserError, match=message):
        tiny_config(**options)


def _tp_modes(rank: int, world: int, cfg: ModelConfig, weights, data):
    out = {}
    for mode, options in {"none": {}, **MODES}.items():
        ps = ParallelState.from_distributed(ParallelConfig(tp=world))
        loss, grads, saved = _step(dataclasses.replace(cfg, **options), weights, data, ps)
        out[mode] = {"loss": loss, "grads": grads, "saved": saved}
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "bert"])
def test_tp2_sequence_parallel_recompute_equals_no_recompute_with_dropout(family: str) -> None:
    """Under TP 2 + SP the per-rank dropout generators are replayed too (attention, hidden, embedding)."""
    cfg, weights, data = _case(family)
    cfg = dataclasses.replace(cfg, sequence_parallel=True)
    for r in run_distributed(_tp_modes, 2, cfg, weights, data):
        ref = r["none"]
        for mode in MODES:
            assert torch.equal(r[mode]["loss"], ref["loss"]), mode
            for name, g in ref["grads"].items():
                torch.testing.assert_close(r[mode]["grads"][name], g, rtol=0, atol=0, msg=f"{mode} {name}")
            assert r[mode]["saved"] < ref["saved"], mode
