"""Tensor-parallel GPT equals the single-process model: logits, loss and every gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pretrain.models.gpt import GPTModel
from pretrain.models.init import init_model_parameters
from pretrain.models.sharding import gather_full_state_dict, load_full_state_dict
from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.state import ParallelState
from pretrain.tensor_parallel.cross_entropy import masked_mean
from pretrain.tensor_parallel.vocab import padded_vocab_size
from tests.distributed import run_distributed
from tests.gpt_fixtures import batch, full_weights, single_process_reference, tiny_config

TOL = {"rtol": 1e-5, "atol": 1e-6}


def _tp_step(rank: int, world: int, cfg, weights, data):
    ps = ParallelState.from_distributed(ParallelConfig(tp=world), seed=0)
    model = GPTModel(cfg, ps)
    assert model.padded_vocab == padded_vocab_size(cfg.vocab_size, tp=world)
    load_full_state_dict(model, weights)
    logits = model.full_logits(model(data["tokens"]))
    loss = masked_mean(model(data["tokens"], labels=data["labels"]), data["loss_mask"])
    loss.backward()
    return {
        "logits": logits.detach(),
        "loss": loss.detach(),
        "grads": gather_full_state_dict(model, grads=True),
    }


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_equals_single_process(tp: int) -> None:
    cfg = tiny_config(num_attention_heads=8)
    weights = full_weights(cfg)
    data = batch(cfg)
    ref_logits, ref_loss, ref_grads = single_process_reference(cfg, weights, data)
    results = run_distributed(_tp_step, tp, cfg, weights, data)
    for r in results:
        torch.testing.assert_close(r["logits"], ref_logits, **TOL)
        torch.testing.assert_close(r["loss"], ref_loss, **TOL)
        assert set(r["grads"]) == set(ref_grads)
        for name, g in ref_grads.items():
            torch.testing.assert_close(r["grads"][name], g, **TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow
def test_tp8_equals_single_process() -> None:
    cfg = tiny_config(num_layers=1, ffn_hidden_size=64)
    weights = full_weights(cfg)
    data = batch(cfg, b=2, s=8)
    ref_logits, ref_loss, ref_grads = single_process_reference(cfg, weights, data)
    results = run_distributed(_tp_step, 8, cfg, weights, data)
    torch.testing.assert_close(results[3]["logits"], ref_logits, **TOL)
    torch.testing.assert_close(results[5]["loss"], ref_loss, **TOL)
    for name, g in ref_grads.items():
        torch.testing.assert_close(results[7]["grads"][name], g, **TOL)


def _init_full(rank: int, world: int, cfg):
    ps = ParallelState.from_distributed(ParallelConfig(tp=world))
    model = GPTModel(cfg, ps)
    init_model_parameters(model, seed=42)
    return gather_full_state_dict(model)


@pytest.mark.slow
def test_initialisation_is_layout_independent() -> None:
    cfg = tiny_config()
    single = GPTModel(cfg, ParallelState.single())
    init_model_parameters(single, seed=42)
    ref = gather_full_state_dict(single)
    # Output projections use std / sqrt(2N); biases zero; LayerNorm ones.
    dense = ref["language_model.encoder.layers.1.self_attention.dense.weight"]
    qkv = ref["language_model.encoder.layers.1.self_attention.query_key_value.weight"]
    assert abs(dense.std().item() - 0.02 / 2.0) < 0.002 and abs(qkv.std().item() - 0.02) < 0.002
    assert torch.all(ref["language_model.encoder.layers.0.mlp.dense_h_to_4h.bias"] == 0)
    assert torch.all(ref["language_model.encoder.final_layernorm.weight"] == 1)
    (full,) = run_distributed(_init_full, 2, cfg)[:1]
    for k, v in ref.items():
        assert torch.equal(full[k], v), k


def _ce_worker(rank: int, world: int, logits_full, target, mask, vocab):
    from pretrain.tensor_parallel.cross_entropy import mask_padded_vocab, vocab_parallel_cross_entropy

    ps = ParallelState.from_distributed(ParallelConfig(tp=world))
    padded = padded_vocab_size(vocab, tp=world, divisible_by=8)
    # Padded columns hold huge garbage: they must not change the result.
    full = torch.cat([logits_full, torch.full((*logits_full.shape[:-1], padded - vocab), 50.0)], dim=-1)
    per = padded // world
    local = full[..., rank * per : (rank + 1) * per].clone().requires_grad_(True)
    masked = mask_padded_vocab(local, vocab_start=rank * per, true_vocab=vocab)
    losses = vocab_parallel_cross_entropy(masked, target, vocab_start=rank * per, group=ps.tp_group)
    loss = masked_mean(losses, mask)
    loss.backward()
    return {"losses": losses.detach(), "loss": loss.detach(), "grad": local.grad}


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 4])
def test_vocab_parallel_cross_entropy_matches_torch(world: int) -> None:
    vocab = 37
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 5, vocab, generator=gen) * 3
    target = torch.randint(0, vocab, (3, 5), generator=gen)
    mask = (torch.rand(3, 5, generator=gen) > 0.3).float()
    ref_in = logits.clone().requires_grad_(True)
    ref_losses = F.cross_entropy(ref_in.flatten(0, 1), target.flatten(), reduction="none").view(3, 5)
    ref_loss = (ref_losses * mask).sum() / mask.sum()
    ref_loss.backward()
    results = run_distributed(_ce_worker, world, logits, target, mask, vocab)
    padded = padded_vocab_size(vocab, tp=world, divisible_by=8)
    grad = torch.cat([r["grad"] for r in results], dim=-1)
    torch.testing.assert_close(grad[..., :vocab], ref_in.grad, rtol=1e-5, atol=1e-7)
    assert torch.all(grad[..., vocab:padded] == 0)
    for r in results:
        torch.testing.assert_close(r["losses"], ref_losses.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(r["loss"], ref_loss.detach(), rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_tp4_with_ranks_holding_only_padding() -> None:
    # vocab 100 at tp=4 pads to 512: ranks 1..3 hold no real vocabulary row at all.
    cfg = tiny_config(vocab_size=100, num_attention_heads=4)
    weights = full_weights(cfg)
    data = batch(cfg)
    ref_logits, ref_loss, ref_grads = single_process_reference(cfg, weights, data)
    results = run_distributed(_tp_step, 4, cfg, weights, data)
    for r in results:
        assert r["logits"].shape[-1] == 100
        torch.testing.assert_close(r["logits"], ref_logits, **TOL)
        torch.testing.assert_close(r["loss"], ref_loss, **TOL)
        for name, g in ref_grads.items():
            torch.testing.assert_close(r["grads"][name], g, **TOL)
