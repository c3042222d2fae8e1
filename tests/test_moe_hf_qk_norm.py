"""OLMoE's full-width QK-norm (``qk_layernorm_full_width``): one RMSNorm over the whole query
projection ``[nq d]`` and key projection ``[g d]``, never per head; equals transformers' OLMoE
attention, and under TP 2 (the sum of squares all-reduced, the weights sharded with the heads)
equals one process in logits, loss and every gradient."""

from __future__ import annotations

import pytest
import torch

from pretrain.config import ModelConfig
from pretrain.utils.errors import UserError
from tests.distributed import run_distributed
from tests.gpt_fixtures import batch, single_process_reference
from tests.test_moe_parallel import moe_config, moe_weights
from tests.test_tensor_parallel_gpt import _tp_step

TOL = {"rtol": 1e-5, "atol": 1e-6}
Q_NORM = "language_model.encoder.layers.0.self_attention.q_full_layernorm.weight"


def _cfg(**kw: object) -> ModelConfig:
    return moe_config(qk_layernorm_full_width=True, num_query_groups=2, **kw)


def test_full_width_norm_weights_span_all_heads() -> None:
    cfg = _cfg()
    full = moe_weights(cfg)
    assert full[Q_NORM].shape == (cfg.num_attention_heads * cfg.head_dim,)
    k_norm = Q_NORM.replace("q_full", "k_full")
    assert full[k_norm].shape == (cfg.query_groups * cfg.head_dim,)
    assert not any("q_layernorm" in n for n in full)  # never Qwen3's per-head norm


def test_full_width_excludes_per_head_and_replicated_groups() -> None:
    with pytest.raises(UserError, match="qk_layernorm_full_width"):
        _cfg(qk_layernorm=True)
    with pytest.raises(UserError, match="full-width key norm"):
        _cfg().check_tensor_parallel(4)  # 2 key-value groups on 4 ranks


def test_full_width_norm_is_not_per_head() -> None:
    """Scaling one head's queries changes the other heads' normalised queries (a per-head norm
    would leave them alone)."""
    from pretrain.models.norms import FullWidthRMSNorm

    norm = FullWidthRMSNorm(8, eps=1e-6, group=None)
    torch.nn.init.ones_(norm.weight)
    x = torch.randn(3, 8)
    y = x.clone()
    y[:, :4] *= 10.0
    assert not torch.allclose(norm(x)[:, 4:], norm(y)[:, 4:])


@pytest.mark.slow
def test_tp2_equals_single_process() -> None:
    cfg = _cfg()
    weights, data = moe_weights(cfg), batch(cfg)
    gen = torch.Generator().manual_seed(5)
    for name in weights:  # norm weights away from one, so a mis-sharded weight shows
        if "full_layernorm" in name:
            weights[name] = 1.0 + 0.3 * torch.randn(weights[name].shape, generator=gen)
    ref_logits, ref_loss, ref_grads = single_process_reference(cfg, weights, data)
    assert float(ref_grads[Q_NORM].abs().sum()) > 0
    for r in run_distributed(_tp_step, 2, cfg, weights, data):
        torch.testing.assert_close(r["logits"], ref_logits, **TOL)
        torch.testing.assert_close(r["loss"], ref_loss, **TOL)
        assert set(r["grads"]) == set(ref_grads)
        for name, g in ref_grads.items():
            torch.testing.assert_close(r["grads"][name], g, **TOL, msg=lambda m, n=name: f"{n}: {m}")
