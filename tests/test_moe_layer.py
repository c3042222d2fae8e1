"""The mixture-of-experts MLP: megatron-core's routing semantics, and the MoE blocks of transformers'
Mixtral (renormalised top-k) and Qwen2-MoE (no renormalisation, gated shared expert), exactly."""

from __future__ import annotations

import pytest
import torch

from pretrain.config import ModelConfig
from pretrain.models.moe.layer import MoEMLP
from pretrain.models.moe.router import route
from pretrain.parallel.state import ParallelState
from pretrain.utils.errors import UserError

HIDDEN, EXPERTS, TOPK, FFN = 32, 6, 2, 24


def _cfg(**kw: object) -> ModelConfig:
    base: dict[str, object] = dict(
        num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, vocab_size=50, max_position_embeddings=16,
        normalization="RMSNorm", swiglu=True, position_embedding_type="rope", add_bias_linear=False,
        num_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=FFN, hidden_dropout=0.0,
        attention_dropout=0.0,
    )  # fmt: skip
    base.update(kw)
    return ModelConfig(**base)  # type: ignore[arg-type]


def _wide_logits(tokens: int = 64) -> torch.Tensor:
    """Router logits with a wide spread, so the top-k differs between tokens."""
    return 3.0 * torch.randn(tokens, EXPERTS, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    ("pre_softmax", "score", "scale"),
    [(False, "softmax", None), (True, "softmax", None), (False, "sigmoid", None), (True, "softmax", 2.5)],
)
def test_routing_equals_megatron_core(pre_softmax: bool, score: str, scale: float | None) -> None:
    moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    logits = _wide_logits()
    want_probs, want_map = moe_utils.topk_routing_with_score_function(
        logits, TOPK, use_pre_softmax=pre_softmax, score_function=score, scaling_factor=scale
    )
    probs, experts = route(
        logits, topk=TOPK, pre_softmax=pre_softmax, score_function=score, scaling_factor=scale
    )
    got = torch.zeros_like(logits).scatter(1, experts, probs)
    assert torch.equal(got != 0, want_map)
    torch.testing.assert_close(got, want_probs, rtol=1e-6, atol=1e-7)
    assert len({tuple(sorted(r)) for r in experts.tolist()}) > 3  # the spread makes routes differ


def test_hf_norm_topk_prob_is_megatron_pre_softmax_off() -> None:
    """Renormalising the top-k of a full softmax (HF norm_topk_prob=True) is Megatron's default;
    keeping them (norm_topk_prob=False) is --moe-router-pre-softmax."""
    logits = _wide_logits()
    full = torch.softmax(logits, dim=-1)
    top, idx = torch.topk(full, TOPK, dim=-1)
    probs, experts = route(logits, topk=TOPK, pre_softmax=False, score_function="softmax")
    assert torch.equal(experts, idx)
    torch.testing.assert_close(probs, top / top.sum(-1, keepdim=True))
    probs, _ = route(logits, topk=TOPK, pre_softmax=True, score_function="softmax")
    torch.testing.assert_close(probs, top)


def _fill_from_hf(ours: MoEMLP, hf_block: torch.nn.Module, *, shared: bool) -> None:
    sd = hf_block.state_dict()
    with torch.no_grad():
        ours.router.weight.copy_(sd["gate.weight"])
        for e, expert in enumerate(ours.experts):
            expert.dense_h_to_4h.weight.copy_(sd["experts.gate_up_proj"][e])
            expert.dense_4h_to_h.weight.copy_(sd["experts.down_proj"][e])
        if shared:
            se = ours.shared_experts
            se.dense_h_to_4h.weight.copy_(
                torch.cat([sd["shared_expert.gate_proj.weight"], sd["shared_expert.up_proj.weight"]])
            )
            se.dense_4h_to_h.weight.copy_(sd["shared_expert.down_proj.weight"])
            se.gate_weight.copy_(sd["shared_expert_gate.weight"])


def _hf_block(model_type: str, **kw: object) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(
        model_type, hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
        vocab_size=50, **kw,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    block = model.model.layers[0].mlp
    with torch.no_grad():
        block.gate.weight.mul_(40.0)  # a wide router spread
    return block


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe"])
def test_moe_mlp_equals_transformers_block(model_type: str) -> None:
    if model_type == "mixtral":
        block = _hf_block(
            "mixtral", num_local_experts=EXPERTS, num_experts_per_tok=TOPK, intermediate_size=FFN
        )
        cfg = _cfg()
    else:
        block = _hf_block(
            "qwen2_moe", num_experts=EXPERTS, num_experts_per_tok=TOPK, moe_intermediate_size=FFN,
            shared_expert_intermediate_size=40, norm_topk_prob=False,
        )  # fmt: skip
        cfg = _cfg(
            moe_router_pre_softmax=True, moe_shared_expert_intermediate_size=40, moe_shared_expert_gate=True
        )
    ours = MoEMLP(cfg, ParallelState.single())
    _fill_from_hf(ours, block, shared=model_type == "qwen2_moe")
    x = torch.randn(3, 11, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = block(x)
        want = want[0] if isinstance(want, tuple) else want
        got = ours(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert ours.tokens_per_expert is not None and int(ours.tokens_per_expert.sum()) == 33 * TOPK
    assert int((ours.tokens_per_expert > 0).sum()) > 2


def test_moe_layer_frequency_and_refusals() -> None:
    cfg = _cfg(num_layers=4, moe_layer_freq=2)
    assert [cfg.is_moe_layer(i) for i in range(4)] == [True, False, True, False]
    cfg = _cfg(num_layers=3, moe_layer_freq=(0, 1, 1))
    assert [cfg.is_moe_layer(i) for i in range(3)] == [False, True, True]
    with pytest.raises(UserError, match="moe_router_topk 7"):
        _cfg(moe_router_topk=7)
    with pytest.raises(UserError, match="add_bias_linear"):
        _cfg(add_bias_linear=True)
    with pytest.raises(UserError, match="one 0/1 per layer"):
        _cfg(moe_layer_freq=(1, 0, 1))
    with pytest.raises(UserError, match="moe_ffn_hidden_size 24 is not divisible by --tp 5"):
        _cfg(num_attention_heads=5, hidden_size=40, ffn_hidden_size=80).check_tensor_parallel(5)


def test_megatron_moe_args_and_flags_read_through_the_table() -> None:
    from pretrain.model_option_codecs import parse_layer_freq
    from pretrain.model_options import args_from_config, check_refused, config_kwargs_from_args

    assert parse_layer_freq("([1]*3+[0]*1)") == (1, 1, 1, 0) and parse_layer_freq("2") == 2
    with pytest.raises(UserError, match="--moe-layer-freq"):
        parse_layer_freq("[2,1]")
    cfg = _cfg(num_layers=4, moe_layer_freq=(1, 0, 1, 1), moe_router_pre_softmax=True,
               moe_shared_expert_intermediate_size=40, moe_shared_expert_gate=True)  # fmt: skip
    args = args_from_config(cfg, mcore=True)
    assert args["num_experts"] == EXPERTS and args["moe_layer_freq"] == [1, 0, 1, 1]
    back = config_kwargs_from_args(args, source="args")
    for name in ("num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq", "moe_router_pre_softmax",
                 "moe_shared_expert_intermediate_size", "moe_shared_expert_gate"):  # fmt: skip
        assert back[name] == getattr(cfg, name), name
    with pytest.raises(UserError, match="moe_router_enable_expert_bias"):
        check_refused({"moe_router_enable_expert_bias": True}, "args")
