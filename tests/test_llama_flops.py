"""The TFLOP/s formula (Megatron's num_floating_point_operations) against hand-counted matmuls:
GQA shrinks the K/V projections, SwiGLU has three FFN matrices, recomputation adds a forward."""

from __future__ import annotations

import pytest

from pretrain.config import ModelConfig
from pretrain.training.flops import gpt_flops_per_iteration


def _llama(**kw: object) -> ModelConfig:
    base: dict[str, object] = dict(
        num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8, ffn_hidden_size=11008,
        swiglu=True, vocab_size=32000, max_position_embeddings=4096, normalization="RMSNorm",
        position_embedding_type="rope", add_bias_linear=False,
    )  # fmt: skip
    base.update(kw)
    return ModelConfig(**base)  # type: ignore[arg-type]


def test_llama_gqa_swiglu_equals_the_hand_count() -> None:
    h, heads, groups, d, ffn, layers, s, vocab = 4096, 32, 8, 128, 11008, 32, 4096, 32000
    weights = h * (heads * d + 2 * groups * d) + heads * d * h + 3 * h * ffn  # QKV (GQA), dense, gate+up+down
    assert weights == 177_209_344
    per_token_layer = 2 * weights + 2 * 2 * s * heads * d  # matmuls + QK^T and AV
    want = s * (3 * layers * per_token_layer + 6 * h * vocab)  # fwd + 2 bwd; output layer
    assert want == 168_972_603_359_232
    assert gpt_flops_per_iteration(_llama(), global_batch=1, seq_length=s, padded_vocab=vocab) == want
    # GQA and SwiGLU matter: multi-head attention and a GeLU MLP of the same width cost more / less.
    mha = gpt_flops_per_iteration(
        _llama(num_query_groups=None), global_batch=1, seq_length=s, padded_vocab=vocab
    )
    assert mha - want == s * 3 * layers * 2 * h * 2 * (heads - groups) * d
    gelu = gpt_flops_per_iteration(_llama(swiglu=False), global_batch=1, seq_length=s, padded_vocab=vocab)
    assert want - gelu == s * 3 * layers * 2 * h * ffn


def test_gpt2_with_recompute_is_the_papers_equation_3() -> None:
    b, s, l_, h, v = 8, 1024, 24, 1024, 50304
    cfg = ModelConfig(num_layers=l_, hidden_size=h, num_attention_heads=16, vocab_size=50257,
                      max_position_embeddings=s, recompute_activations=True)  # fmt: skip
    paper = 96 * b * s * l_ * h * h * (1 + s / (6 * h) + v / (16 * l_ * h))
    assert gpt_flops_per_iteration(cfg, global_batch=b, seq_length=s, padded_vocab=v) == pytest.approx(
        paper, rel=1e-12
    )
