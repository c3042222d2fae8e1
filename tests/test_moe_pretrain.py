"""Mixture-of-experts decoders through mlm-pretrain: Megatron's MoE flags build the model, the log
reports the router losses and each layer's tokens per expert, TFLOP/s count active parameters,
the checkpoint records the MoE args, and resume is bitwise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pretrain.checkpoint.opener import load_canonical
from pretrain.config import ModelConfig
from pretrain.training.cli import main as pretrain_main
from pretrain.training.flops import gpt_flops_per_iteration
from tests.train_fixtures import gpt_args

MOE = {
    "normalization": "RMSNorm", "swiglu": True, "position-embedding-type": "rope", "disable-bias-linear": True,
    "untie-embeddings-and-output-weights": True, "ffn-hidden-size": 48, "num-experts": 4, "moe-router-topk": 2,
    "moe-ffn-hidden-size": 24, "moe-layer-freq": "[1,0]", "moe-aux-loss-coeff": 0.01, "moe-z-loss-coeff": 0.001,
    "moe-shared-expert-intermediate-size": 32, "num-layers": 2,
}  # fmt: skip


def _records(path: Path) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]


def test_moe_pretrain_logs_router_stats_and_resumes_bitwise(
    gpt_data: dict[str, str], tmp_path: Path, capsys
) -> None:
    full = gpt_args(gpt_data, **MOE, **{"train-iters": 4, "save": tmp_path / "full", "log-json": tmp_path / "f.jsonl",
                                        "log-interval": 1})  # type: ignore[arg-type]  # fmt: skip
    assert pretrain_main(full) == 0
    out = capsys.readouterr()
    assert "layer   0 tokens per expert:" in out.out + out.err
    recs = _records(tmp_path / "f.jsonl")
    first = recs[0]
    assert set(first["tokens_per_expert"]) == {"0"}  # layer 1 is dense
    assert (
        sum(first["tokens_per_expert"]["0"]) > 0 and first["load_balancing_loss"] > 0 and first["z_loss"] > 0
    )
    half = gpt_args(
        gpt_data, **MOE, **{"train-iters": 2, "save": tmp_path / "ck", "log-json": tmp_path / "a.jsonl"}
    )  # type: ignore[arg-type]
    assert pretrain_main(half) == 0
    rest = gpt_args(gpt_data, **MOE, **{"train-iters": 4, "load": tmp_path / "ck", "save": tmp_path / "ck",
                                        "log-json": tmp_path / "b.jsonl"})  # type: ignore[arg-type]  # fmt: skip
    assert pretrain_main(rest) == 0
    losses = [r["loss"] for r in _records(tmp_path / "a.jsonl") + _records(tmp_path / "b.jsonl")]
    assert losses == [r["loss"] for r in recs]  # bitwise
    _, spec, _ = load_canonical(tmp_path / "full", iteration=4)
    cfg = spec.cfg
    assert (cfg.num_experts, cfg.moe_router_topk, cfg.moe_layer_freq) == (4, 2, (1, 0))
    assert cfg.moe_shared_expert_intermediate_size == 32 and cfg.moe_aux_loss_coeff == pytest.approx(0.01)


def test_moe_flops_follow_megatron_active_parameter_formula() -> None:
    cfg = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=8, vocab_size=1000, max_position_embeddings=32,
                      normalization="RMSNorm", swiglu=True, position_embedding_type="rope", add_bias_linear=False,
                      ffn_hidden_size=256, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=96,
                      moe_layer_freq=(0, 1, 1, 1), moe_shared_expert_intermediate_size=64)  # fmt: skip
    b, s, h, v = 8, 32, 64, 1024
    # Megatron-LM training.py: 3 passes x (attention + dense MLP or moe_layer_flops) + logits
    attn = 4 * b * s * h * h * (1 + 1 + s / h)  # GQA off: (1 + g/n + s/h) x q/h, q = h
    dense = 4 * b * s * h * 256 * 1.5
    moe = 4 * b * s * h * (96 * 2 + 64) * 1.5
    want = 3 * (4 * attn + dense + 3 * moe) + 6 * b * s * h * v
    assert gpt_flops_per_iteration(cfg, global_batch=b, seq_length=s, padded_vocab=v) == pytest.approx(want)
