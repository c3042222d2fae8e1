"""Our GPT model configured as a Llama-family decoder equals Hugging Face's, logit for logit."""

from __future__ import annotations

import pytest
import torch

from pretrain.models.families import llama as hf_llama
from pretrain.models.gpt import GPTModel
from pretrain.models.sharding import load_full_state_dict
from pretrain.parallel.state import ParallelState
from tests.llama_fixtures import HF_CASES, hf_model

pytest.importorskip("transformers")


def _ours(hf) -> tuple[GPTModel, dict[str, torch.Tensor]]:
    cfg = hf_llama.model_config_from_hf(hf.config)
    full = hf_llama.hf_to_canonical(hf.state_dict(), cfg)
    model = GPTModel(cfg, ParallelState.single()).eval()
    load_full_state_dict(model, full)
    return model, full


@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_logits_equal_transformers(case: str) -> None:
    hf = hf_model(case)
    ours, _ = _ours(hf)
    ids = torch.randint(0, hf.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = hf(ids).logits
        got = ours.full_logits(ours(ids))
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_hf_state_dict_round_trips_exactly(case: str) -> None:
    hf = hf_model(case)
    cfg = hf_llama.model_config_from_hf(hf.config)
    state = {
        k: v
        for k, v in hf.state_dict().items()
        if not (cfg.untie_embeddings_and_output_weights is False and k == "lm_head.weight")
    }
    back = hf_llama.canonical_to_hf(hf_llama.hf_to_canonical(state, cfg), cfg)
    assert set(back) == set(state)
    for name, t in state.items():
        assert torch.equal(back[name], t), name


def test_config_features_are_read() -> None:
    cfg = hf_llama.model_config_from_hf(hf_model("llama3").config)
    assert cfg.use_rope_scaling and cfg.rope_original_max_position_embeddings == 16
    assert cfg.rotary_base == 500000.0 and cfg.num_query_groups == 2
    assert cfg.untie_embeddings_and_output_weights and not cfg.add_bias_linear
    assert hf_llama.model_config_from_hf(hf_model("qwen2").config).add_qkv_bias
    q3 = hf_llama.model_config_from_hf(hf_model("qwen3").config)
    assert q3.qk_layernorm and q3.kv_channels == 12
    lin = hf_llama.model_config_from_hf(hf_model("llama_linear_tied").config)
    assert lin.rotary_seq_len_interpolation_factor == 2.0 and not lin.untie_embeddings_and_output_weights


def test_gqa_rows_follow_megatron_group_order() -> None:
    """Row block j of group g: q heads g*4 .. g*4+3, then k head g, then v head g."""
    d, groups = 3, 2
    q = torch.arange(8 * d).float().reshape(8 * d, 1)
    k = 100 + torch.arange(groups * d).float().reshape(groups * d, 1)
    v = 200 + torch.arange(groups * d).float().reshape(groups * d, 1)
    fused = hf_llama.fuse_qkv(q, k, v, groups=groups, head_dim=d).reshape(groups, 6, d)
    assert torch.equal(fused[1, 0], q[12:15, 0]) and torch.equal(fused[1, 4], k[3:6, 0])
    assert torch.equal(fused[0, 5], v[0:3, 0])
    back = hf_llama.split_qkv(fused.reshape(-1, 1), groups=groups, head_dim=d)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v), strict=True))
