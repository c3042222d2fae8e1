"""BERT: TP x PP step equals one process; Hugging Face BERT / Megatron-BERT give the same logits."""

from __future__ import annotations

import os
from functools import partial
from typing import Any

import pytest
import torch

from pretrain.config import ModelConfig
from pretrain.models.bert import BertModel, bert_forward_step, bert_loss_fn, bert_model_provider
from pretrain.models.families.bert import (
    canonical_to_hf,
    hf_config_kwargs,
    hf_to_canonical,
    model_config_from_hf,
)
from pretrain.models.init import init_model_parameters
from pretrain.models.sharding import gather_full_state_dict, load_full_state_dict
from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.state import ParallelState
from pretrain.pipeline.embedding_sync import allreduce_embedding_grads
from pretrain.pipeline.partition import build_model_chunks
from pretrain.pipeline.schedules import forward_backward
from pretrain.utils.errors import UserError
from tests.distributed import run_distributed

os.environ.setdefault("HF_HUB_OFFLINE", "1")
TOL: dict[str, Any] = {"rtol": 1e-5, "atol": 1e-6}


def bert_config(**overrides: object) -> ModelConfig:
    """1003 tokens: the vocabulary needs padding (1024) at tp 1 and 2."""
    kw: dict[str, object] = dict(
        num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=1003, max_position_embeddings=16,
        hidden_dropout=0.0, attention_dropout=0.0, bidirectional=True, num_tokentypes=2, gelu="erf",
    )  # fmt: skip
    kw.update(overrides)
    return ModelConfig(**kw)  # type: ignore[arg-type]


def full_weights(cfg: ModelConfig, seed: int = 99) -> dict[str, torch.Tensor]:
    """Seeded init plus noise, so biases (incl. ``lm_head.bias``) and LayerNorms are non-trivial."""
    model = BertModel(cfg, ParallelState.single())
    init_model_parameters(model, seed=seed)
    full = gather_full_state_dict(model)
    gen = torch.Generator().manual_seed(seed + 1)
    return {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in full.items()}


def bert_batch(cfg: ModelConfig, *, b: int = 8, s: int = 12, seed: int = 5) -> dict[str, torch.Tensor]:
    """Random [CLS] A [SEP] B [SEP]-shaped batch with trailing padding and ~25% masked positions."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(s // 2, s + 1, (b,), generator=gen)
    lengths[0] = s  # one row without padding
    real = torch.arange(s)[None, :] < lengths[:, None]
    tokens = torch.randint(0, cfg.vocab_size, (b, s), generator=gen).masked_fill(~real, 0)
    split = lengths // 2
    tokentypes = ((torch.arange(s)[None, :] >= split[:, None]) & real).long()
    loss_mask = ((torch.rand(b, s, generator=gen) < 0.25) & real).float()
    loss_mask[:, 1] = 1.0  # at least one masked token per row
    labels = torch.randint(0, cfg.vocab_size, (b, s), generator=gen).masked_fill(loss_mask == 0, -1)
    return {
        "tokens": tokens, "tokentype_ids": tokentypes, "attention_mask": real.long(), "labels": labels,
        "loss_mask": loss_mask, "is_random": torch.randint(0, 2, (b,), generator=gen),
    }  # fmt: skip


def _loss_fn(data: dict[str, torch.Tensor]):
    return partial(
        bert_loss_fn, num_masked_tokens=data["loss_mask"].sum(), num_samples=data["tokens"].shape[0]
    )


def single_process_step(cfg: ModelConfig, weights, data):
    model = BertModel(cfg, ParallelState.single())
    load_full_state_dict(model, weights)
    loss = _loss_fn(data)(bert_forward_step(model, data, None, True), data)
    loss.backward()
    return loss.detach(), gather_full_state_dict(model, grads=True)


def _microbatches(data: dict[str, torch.Tensor], m: int) -> list[dict[str, torch.Tensor]]:
    return [dict(zip(data, parts)) for parts in zip(*(t.chunk(m) for t in data.values()))]


def _parallel_step(rank: int, world: int, cfg, weights, data, tp: int, pp: int, m: int):
    ps = ParallelState.from_distributed(ParallelConfig(tp=tp, pp=pp), seed=0)
    chunks = build_model_chunks(cfg, ps, bert_model_provider())
    for chunk in chunks:
        load_full_state_dict(chunk, weights)
    losses, _ = forward_backward(
        chunks=chunks, ps=ps, microbatches=_microbatches(data, m), loss_fn=_loss_fn(data),
        finalize_grads=lambda: allreduce_embedding_grads(chunks, ps), forward_step=bert_forward_step,
    )  # fmt: skip
    grads: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        grads.update(gather_full_state_dict(chunk, grads=True))
    return {"last": ps.is_last_stage, "loss": torch.stack(losses).sum() if losses else None, "grads": grads}


@pytest.mark.slow
@pytest.mark.parametrize("post_layernorm", [False, True])
def test_tp2_pp2_step_equals_single_process(post_layernorm: bool) -> None:
    cfg = bert_config(post_layernorm=post_layernorm)
    weights, data = full_weights(cfg), bert_batch(cfg)
    ref_loss, ref_grads = single_process_step(cfg, weights, data)
    results = run_distributed(_parallel_step, 4, cfg, weights, data, 2, 2, 4)
    merged: dict[str, torch.Tensor] = {}
    for r in results:
        merged.update(r["grads"])
        if r["last"]:
            torch.testing.assert_close(r["loss"], ref_loss, **TOL)
    assert set(merged) == set(ref_grads)
    assert "lm_head.bias" in merged and "binary_head.weight" in merged
    for name, g in ref_grads.items():
        assert g.abs().sum() > 0, f"{name}: zero reference gradient makes the check vacuous"
        for r in results:  # every holder (incl. the tied head copy on the last stage) has the full grad
            if name in r["grads"]:
                torch.testing.assert_close(r["grads"][name], g, **TOL, msg=f"gradient of {name}")


def test_padding_is_masked() -> None:
    cfg = bert_config()
    model = BertModel(cfg, ParallelState.single())
    load_full_state_dict(model, full_weights(cfg))
    data = bert_batch(cfg)
    real = data["attention_mask"].bool()
    with torch.no_grad():
        logits, sop = model(data["tokens"], data["attention_mask"], data["tokentype_ids"])
        other = data["tokens"].masked_fill(~real, 7)  # change only padded ids
        logits2, sop2 = model(other, data["attention_mask"], data["tokentype_ids"])
        unmasked, _ = model(other, None, data["tokentype_ids"])
    assert logits.shape == (8, 12, cfg.vocab_size) and sop.shape == (8, 2)  # padded rows not computed
    torch.testing.assert_close(logits[real], logits2[real], **TOL)
    torch.testing.assert_close(sop, sop2, **TOL)
    assert not torch.allclose(unmasked[real], logits[real], atol=1e-3)  # the mask does matter


def test_validation_errors() -> None:
    with pytest.raises(UserError, match="bidirectional"):
        BertModel(bert_config(bidirectional=False), ParallelState.single())
    without = BertModel(bert_config(), ParallelState.single(), add_binary_head=False)
    names = {n for n, _ in without.named_parameters()}
    assert not any(n.startswith(("binary_head", "language_model.pooler")) for n in names)


# --- Hugging Face ----------------------------------------------------------------------------------


def _hf_model(megatron: bool):
    import transformers

    kw: dict[str, Any] = dict(
        vocab_size=1003, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=16, hidden_act="gelu", hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, type_vocab_size=2,
    )  # fmt: skip
    conf_cls: Any = transformers.MegatronBertConfig if megatron else transformers.BertConfig
    model_cls: Any = transformers.MegatronBertForPreTraining if megatron else transformers.BertForPreTraining
    torch.manual_seed(0)
    hf = model_cls(conf_cls(**kw)).eval()
    with torch.no_grad():  # make LayerNorms and biases non-trivial (ties are shared parameters)
        for p in hf.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return hf


@pytest.mark.parametrize("megatron", [False, True])
def test_matches_hugging_face(megatron: bool) -> None:
    hf = _hf_model(megatron)
    cfg = model_config_from_hf(hf.config)
    assert cfg.post_layernorm is (not megatron) and cfg.gelu == "erf" and cfg.layernorm_epsilon == 1e-12
    model = BertModel(cfg, ParallelState.single()).eval()
    load_full_state_dict(model, hf_to_canonical(hf.state_dict(), cfg))
    data = bert_batch(cfg, b=4, s=12)
    with torch.no_grad():
        ref = hf(
            input_ids=data["tokens"],
            attention_mask=data["attention_mask"],
            token_type_ids=data["tokentype_ids"],
        )
        logits, sop = model(data["tokens"], data["attention_mask"], data["tokentype_ids"])
    real = data["attention_mask"].bool()
    torch.testing.assert_close(
        model.full_logits(logits)[real], ref.prediction_logits[real], rtol=0, atol=1e-5
    )
    torch.testing.assert_close(sop, ref.seq_relationship_logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("post_layernorm", [False, True])
def test_round_trip_canonical_hf_canonical_is_exact(post_layernorm: bool) -> None:
    import transformers

    cfg = bert_config(
        num_layers=2, post_layernorm=post_layernorm, layernorm_epsilon=1e-12, ffn_hidden_size=128
    )
    full = full_weights(cfg)
    hf_sd = canonical_to_hf(full, cfg)
    back = hf_to_canonical(hf_sd, cfg)
    assert set(back) == set(full)
    for k, v in full.items():
        assert torch.equal(back[k], v), k
    conf_cls: Any = transformers.BertConfig if post_layernorm else transformers.MegatronBertConfig
    model_cls: Any = (
        transformers.BertForPreTraining if post_layernorm else transformers.MegatronBertForPreTraining
    )
    hf = model_cls(conf_cls(**hf_config_kwargs(cfg)))
    hf.load_state_dict(hf_sd, strict=True)  # every HF tensor is produced, with the right shape
    assert model_config_from_hf(hf.config) == cfg


def test_mapping_errors() -> None:
    cfg = bert_config(num_layers=2, post_layernorm=True)
    hf_sd = canonical_to_hf(full_weights(cfg), cfg)
    with pytest.raises(UserError, match=r"missing 1 tensor\(s\): bert.pooler.dense.bias"):
        hf_to_canonical({k: v for k, v in hf_sd.items() if k != "bert.pooler.dense.bias"}, cfg)
    with pytest.raises(UserError, match="unexpected 1 tensor"):
        hf_to_canonical({**hf_sd, "bert.extra.weight": torch.zeros(1)}, cfg)
    with pytest.raises(UserError, match="only a tied decoder"):
        hf_to_canonical({**hf_sd, "cls.predictions.decoder.bias": torch.ones(1003)}, cfg)
    import transformers

    with pytest.raises(UserError, match="hidden_act"):
        model_config_from_hf(transformers.BertConfig(hidden_act="relu"))
