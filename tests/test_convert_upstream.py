"""Reading upstream Megatron-LM checkpoints: eras, names, QKV orders, torch_dist, unsafe pickles."""

from __future__ import annotations

import argparse
import io
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from pretrain.checkpoint.legacy.layout import MODEL_FILE, write_tracker
from pretrain.checkpoint.opener import load_canonical, open_checkpoint
from pretrain.checkpoint.safe_unpickle import load_untrusted
from pretrain.utils.errors import UserError
from tests.convert_fixtures import rewrite_upstream, upstream_args, write_ours
from tests.gpt_fixtures import full_weights, tiny_config

CFG = tiny_config(num_layers=4)


@pytest.fixture(scope="module")
def full() -> dict[str, torch.Tensor]:
    return full_weights(CFG)


def _assert_same(reader, full: dict[str, torch.Tensor]) -> None:
    assert set(reader.names()) == set(full)
    for name, t in full.items():
        assert torch.equal(reader.tensor(name), t), name


@pytest.mark.parametrize(
    ("version", "era", "vp"),
    [(0.0, "old", 1), (1.0, "old", 1), (2.0, "legacy", 2), (3.0, "norm", 1), (3.0, "mcore", 1)],
)
def test_upstream_eras_read_back(tmp_path: Path, full, version: float, era: str, vp: int) -> None:
    write_ours(tmp_path, CFG, full, tp=2, pp=2, vp=vp)
    rewrite_upstream(tmp_path, CFG, version=version, era=era, args=upstream_args(CFG, tp=2, pp=2))
    reader = open_checkpoint(tmp_path, vocab_size=CFG.vocab_size)
    assert (reader.info.checkpoint_version, reader.info.tp, reader.info.pp, reader.info.vp) == (
        version,
        2,
        2,
        vp,
    )
    assert reader.info.kind == "gpt" and not reader.info.ours
    assert reader.spec.cfg.gelu == CFG.gelu and reader.spec.cfg.num_layers == 4
    _assert_same(reader, full)


def test_upstream_vocab_defaults_to_padded_rows(tmp_path: Path, full) -> None:
    write_ours(tmp_path, CFG, full, tp=2, pp=1)
    rewrite_upstream(tmp_path, CFG, version=3.0, era="legacy", args=upstream_args(CFG, tp=2, pp=1))
    reader = open_checkpoint(tmp_path)
    assert reader.info.vocab_size == 1024 and "padded" in reader.info.vocab_source
    emb = reader.tensor("language_model.embedding.word_embeddings.weight")
    assert torch.equal(emb[: CFG.vocab_size], full["language_model.embedding.word_embeddings.weight"])
    assert torch.count_nonzero(emb[CFG.vocab_size :]) == 0


def test_wrong_qkv_version_changes_tensors(tmp_path: Path, full) -> None:
    """The version really drives the reordering: a v0 file read as v3 differs."""
    write_ours(tmp_path, CFG, full, tp=2, pp=1)
    rewrite_upstream(tmp_path, CFG, version=0.0, era="old", args=upstream_args(CFG, tp=2, pp=1))
    for path in tmp_path.glob("iter_*/mp_rank_*/" + MODEL_FILE):
        state = torch.load(path, weights_only=False)  # not mmap'd: we overwrite the file
        state["checkpoint_version"] = 3.0
        torch.save(state, path)
    reader = open_checkpoint(tmp_path, vocab_size=CFG.vocab_size)
    name = "language_model.encoder.layers.0.self_attention.query_key_value.weight"
    assert not torch.equal(reader.tensor(name), full[name])


def test_megatron_enum_and_te_extra_state_become_placeholders(tmp_path: Path, full) -> None:
    import enum
    import sys
    import types

    module = types.ModuleType("fake_megatron_enums")

    class ModelType(enum.Enum):
        encoder_or_decoder = 1

    ModelType.__module__, ModelType.__qualname__ = module.__name__, "ModelType"
    module.ModelType = ModelType  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    args = upstream_args(CFG, tp=1, pp=1)
    args.model_type = ModelType.encoder_or_decoder
    write_ours(tmp_path, CFG, full, tp=1, pp=1)
    rewrite_upstream(tmp_path, CFG, version=3.0, era="mcore", args=args)
    path = next(tmp_path.glob("iter_*/mp_rank_*/" + MODEL_FILE))
    state = torch.load(path, weights_only=False)
    state["model"]["decoder.layers.0.self_attention.linear_qkv._extra_state"] = io.BytesIO(b"te")
    torch.save(state, path)
    del sys.modules[module.__name__]
    reader = open_checkpoint(tmp_path, vocab_size=CFG.vocab_size)
    assert "ModelType" in reader.args["model_type"]
    _assert_same(reader, full)


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_is_refused_and_never_runs(tmp_path: Path, full) -> None:
    write_ours(tmp_path / "ck", CFG, full, tp=1, pp=1)
    marker = tmp_path / "pwned"
    path = next((tmp_path / "ck").glob("iter_*/mp_rank_*/" + MODEL_FILE))
    state = torch.load(path, weights_only=True)
    state["args"] = argparse.Namespace(evil=_Evil(marker))
    torch.save(state, path)
    with pytest.raises(UserError, match=r"unsafe checkpoint file.*system"):
        open_checkpoint(tmp_path / "ck")
    assert not marker.exists()
    torch.save({"x": eval}, path)  # a builtin function, not a class
    with pytest.raises(UserError, match=r"builtins?__\.eval|builtins\.eval"):
        load_untrusted(path)


def _stack(full: dict[str, torch.Tensor], suffix: str, layers: int) -> torch.Tensor:
    return torch.stack([full[f"language_model.encoder.layers.{i}.{suffix}"] for i in range(layers)])


def _torch_dist_state(full: dict[str, torch.Tensor], *, stacked: bool) -> dict[str, torch.Tensor]:
    emb = full["language_model.embedding.word_embeddings.weight"]
    sd = {
        "embedding.word_embeddings.weight": torch.cat([emb, torch.zeros(1024 - emb.shape[0], emb.shape[1])]),
        "embedding.position_embeddings.weight": full["language_model.embedding.position_embeddings.weight"],
        "decoder.final_layernorm.weight": full["language_model.encoder.final_layernorm.weight"],
        "decoder.final_layernorm.bias": full["language_model.encoder.final_layernorm.bias"],
    }
    names = {
        "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
        "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
        "self_attention.linear_qkv.weight": "self_attention.query_key_value.weight",
        "self_attention.linear_qkv.bias": "self_attention.query_key_value.bias",
        "self_attention.linear_proj.weight": "self_attention.dense.weight",
        "self_attention.linear_proj.bias": "self_attention.dense.bias",
        "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
        "mlp.linear_fc1.layer_norm_bias": "post_attention_layernorm.bias",
        "mlp.linear_fc1.weight": "mlp.dense_h_to_4h.weight",
        "mlp.linear_fc1.bias": "mlp.dense_h_to_4h.bias",
        "mlp.linear_fc2.weight": "mlp.dense_4h_to_h.weight",
        "mlp.linear_fc2.bias": "mlp.dense_4h_to_h.bias",
    }
    for mcore, ours in names.items():
        if stacked:
            sd[f"decoder.layers.{mcore}"] = _stack(full, ours, CFG.num_layers)
        else:
            for i in range(CFG.num_layers):
                sd[f"decoder.layers.{i}.{mcore}"] = full[f"language_model.encoder.layers.{i}.{ours}"]
    return sd


@pytest.mark.parametrize("stacked", [True, False])
def test_torch_dist_checkpoint_reads(tmp_path: Path, full, stacked: bool) -> None:
    it_dir = tmp_path / "iter_0000040"
    dcp.save(_torch_dist_state(full, stacked=stacked), checkpoint_id=str(it_dir), no_dist=True)
    args = upstream_args(CFG, tp=2, pp=2)
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 40}, it_dir / "common.pt")
    (it_dir / "metadata.json").write_text('{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')
    write_tracker(tmp_path, 40)
    tensors, spec, info = load_canonical(tmp_path, vocab_size=CFG.vocab_size)
    assert (info.format, info.iteration, spec.kind, spec.cfg.num_layers) == ("torch_dist", 40, "gpt", 4)
    assert set(tensors) == set(full)
    for name, t in full.items():
        assert torch.equal(tensors[name], t), name
