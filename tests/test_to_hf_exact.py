"""to-hf is exact or refused (issue 25 item 2), and verifies its output by default.

Checkpoints here are written by our own model code; tests/test_to_hf_megatron_core.py repeats the
issue's cases on files megatron-core itself wrote. transformers is the judge of every export.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from pretrain.checkpoint.types import ColumnPieces, RowPieces
from pretrain.config import ModelConfig
from pretrain.models.bert import BertModel
from pretrain.models.gpt import GPTModel
from pretrain.models.init import init_model_parameters
from pretrain.models.sharding import gather_full_state_dict, load_full_state_dict
from pretrain.parallel.state import ParallelState
from tests.cli_helpers import one_line_error
from tests.convert_fixtures import write_ours
from tests.gpt_fixtures import full_weights, tiny_config
from tools.convert_cli import main

os.environ["HF_HUB_OFFLINE"] = "1"
LLAMA = dict(normalization="RMSNorm", swiglu=True, position_embedding_type="rope", add_bias_linear=False)


def _checkpoint(tmp_path: Path, **overrides: object) -> tuple[Path, ModelConfig, dict[str, torch.Tensor]]:
    cfg = tiny_config(**overrides)
    full = full_weights(cfg)
    return write_ours(tmp_path / "ck", cfg, full, tp=1, pp=1), cfg, full


def _to_hf(ck: Path, save: Path, *extra: str) -> list[str]:
    return ["to-hf", "--weights-only", "--vocab-size", "1003", "--load", str(ck), "--save", str(save), *extra]


def _no_output_left(save: Path) -> None:
    assert not save.exists()
    assert not [p for p in save.parent.iterdir() if p.name.startswith(f".{save.name}.")]


@pytest.mark.parametrize(
    ("overrides", "option"),
    [
        (dict(qk_layernorm=True), "qk_layernorm=True"),
        (dict(kv_channels=8), "kv_channels=8"),
        (dict(swiglu=True), "swiglu=True"),  # SwiGLU with LayerNorm and learned positions
        (dict(num_query_groups=2), "num_query_groups=2"),  # GQA with LayerNorm and learned positions
        (dict(normalization="RMSNorm"), "normalization=RMSNorm"),
        (dict(LLAMA, position_embedding_type="learned_absolute"), "needs position_embedding_type=rope"),
        (dict(position_embedding_type="rope"), "normalization=LayerNorm"),  # -> Llama family
        (dict(LLAMA, add_bias_linear=True), "add_bias_linear=True"),
        (dict(LLAMA, rotary_percent=0.5), "rotary_percent=0.5"),
    ],
)
def test_options_the_target_lacks_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], overrides: dict[str, object], option: str
) -> None:
    ck, _, _ = _checkpoint(tmp_path, **overrides)
    err = one_line_error(main, _to_hf(ck, tmp_path / "hf"), capsys)
    assert option in err and "cannot express" in err, err
    _no_output_left(tmp_path / "hf")


def _hf_and_ours(
    hf_dir: Path, cfg: ModelConfig, full: dict[str, torch.Tensor]
) -> tuple[object, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), local_files_only=True).eval()
    ours = GPTModel(cfg, ParallelState.single()).eval()
    load_full_state_dict(ours, full)
    tokens = torch.randint(0, cfg.vocab_size, (3, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (hf(tokens).logits - ours.full_logits(ours(tokens))).abs().max()
    return hf, diff


def test_untied_gpt2_writes_lm_head(tmp_path: Path) -> None:
    ck, cfg, full = _checkpoint(tmp_path, untie_embeddings_and_output_weights=True)
    assert main(_to_hf(ck, tmp_path / "hf")) == 0
    hf, diff = _hf_and_ours(tmp_path / "hf", cfg, full)
    assert not hf.config.tie_word_embeddings  # type: ignore[attr-defined]
    assert not torch.equal(hf.lm_head.weight, hf.transformer.wte.weight)  # type: ignore[attr-defined]
    assert diff < 1e-5
    # and back: from-hf reads the untied head into output_layer, to-hf writes the same tensors again
    assert (
        main(["from-hf", "--weights-only", "--load", str(tmp_path / "hf"), "--save", str(tmp_path / "ck2")])
        == 0
    )
    assert main(_to_hf(tmp_path / "ck2", tmp_path / "hf2")) == 0
    from safetensors.torch import load_file

    a, b = (
        load_file(str(tmp_path / "hf" / "model.safetensors")),
        load_file(str(tmp_path / "hf2" / "model.safetensors")),
    )
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_gpt2_without_linear_biases_gets_zero_biases(tmp_path: Path, qkv_bias: bool) -> None:
    ck, cfg, full = _checkpoint(tmp_path, add_bias_linear=False, add_qkv_bias=qkv_bias)
    assert main(_to_hf(ck, tmp_path / "hf")) == 0
    hf, diff = _hf_and_ours(tmp_path / "hf", cfg, full)
    assert diff < 1e-5
    assert torch.count_nonzero(hf.transformer.h[0].mlp.c_fc.bias) == 0  # type: ignore[attr-defined]
    assert (torch.count_nonzero(hf.transformer.h[0].attn.c_attn.bias) > 0) == qkv_bias  # type: ignore[attr-defined]


def _bert_checkpoint(tmp_path: Path, **overrides: object) -> tuple[Path, ModelConfig]:
    kw: dict[str, object] = dict(
        num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=1003, max_position_embeddings=16,
        hidden_dropout=0.0, attention_dropout=0.0, bidirectional=True, num_tokentypes=2,
    )  # fmt: skip
    kw.update(overrides)
    cfg = ModelConfig(**kw)  # type: ignore[arg-type]
    model = BertModel(cfg, ParallelState.single())
    init_model_parameters(model, seed=3)
    gen = torch.Generator().manual_seed(4)
    full = {
        k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in gather_full_state_dict(model).items()
    }
    return write_ours(tmp_path / "ck", cfg, full, tp=1, pp=1, kind="bert"), cfg


@pytest.mark.parametrize(
    "overrides",
    [dict(add_bias_linear=False), dict(add_bias_linear=False, add_qkv_bias=True), dict(squared_relu=True),
     dict(num_tokentypes=0), dict(post_layernorm=True, add_bias_linear=False)],
)  # fmt: skip
@pytest.mark.parametrize("mode", ["full", "per-layer"])
def test_bert_exports_are_exact(tmp_path: Path, overrides: dict[str, object], mode: str,
                                capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    ck, _ = _bert_checkpoint(tmp_path, **overrides)
    assert main(_to_hf(ck, tmp_path / "hf", "--verify", mode)) == 0
    assert f"({mode})" in capsys.readouterr().out


@pytest.mark.parametrize(("overrides", "option"),
                         [(dict(qk_layernorm=True), "qk_layernorm=True"), (dict(kv_channels=4), "kv_channels=4"),
                          (dict(num_query_groups=2), "num_query_groups=2")])  # fmt: skip
def test_bert_options_hf_lacks_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           overrides: dict[str, object], option: str) -> None:  # fmt: skip
    ck, _ = _bert_checkpoint(tmp_path, **overrides)
    err = one_line_error(main, _to_hf(ck, tmp_path / "hf"), capsys)
    assert option in err and "MegatronBertForPreTraining cannot express" in err, err


@pytest.mark.parametrize(
    "overrides",
    [{}, dict(untie_embeddings_and_output_weights=True, add_bias_linear=False),
     dict(LLAMA, num_query_groups=2, untie_embeddings_and_output_weights=True),
     dict(LLAMA, qk_layernorm=True, kv_channels=8), dict(LLAMA, add_qkv_bias=True)],
)  # fmt: skip
def test_per_layer_verification_agrees(tmp_path: Path, overrides: dict[str, object],
                                       capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """--verify per-layer (the mode for models too large for memory) on tiny models: every stage
    (embeddings, each layer, head) compared, and the export kept."""
    ck, _, _ = _checkpoint(tmp_path, **overrides)
    assert main(_to_hf(ck, tmp_path / "hf", "--verify", "per-layer")) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("verify:"))
    assert "(per-layer)" in line and (tmp_path / "hf" / "config.json").is_file()


def _perturbing_writer(monkeypatch: pytest.MonkeyPatch, target: str) -> None:
    """The shard writer scales one tensor by 1.5 (an export bug the verification must catch)."""
    from tools.hf_shards import ShardWriter

    original = ShardWriter.add

    def add(self: ShardWriter, name: str, tensor: torch.Tensor | RowPieces | ColumnPieces) -> None:
        if name == target:  # rows or columns written from the checkpoint's blocks (tools.hf_row_select) too
            if isinstance(tensor, RowPieces | ColumnPieces):
                tensor = torch.cat(tensor.parts, dim=0 if isinstance(tensor, RowPieces) else 1)
            tensor = tensor * 1.5
        original(self, name, tensor)

    monkeypatch.setattr(ShardWriter, "add", add)


@pytest.mark.parametrize("mode", ["full", "per-layer"])
@pytest.mark.parametrize(
    ("overrides", "tensor", "where"),
    [({}, "transformer.h.1.mlp.c_fc.weight", "layer 1"),
     (dict(LLAMA, num_query_groups=2), "model.layers.0.self_attn.k_proj.weight", "layer 0"),
     (dict(untie_embeddings_and_output_weights=True), "lm_head.weight", "output")],
)  # fmt: skip
def test_verification_catches_a_corrupted_export(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    mode: str, overrides: dict[str, object], tensor: str, where: str,
) -> None:  # fmt: skip
    ck, _, _ = _checkpoint(tmp_path, **overrides)
    _perturbing_writer(monkeypatch, tensor)
    err = one_line_error(main, _to_hf(ck, tmp_path / "hf", "--verify", mode), capsys)
    assert "differ" in err and f"first divergence at {where}" in err and "not written" in err, err
    _no_output_left(tmp_path / "hf")
    capsys.readouterr()
    assert main(_to_hf(ck, tmp_path / "hf", "--no-verify")) == 0  # the user's way out
    assert "verify:" not in capsys.readouterr().out


def test_to_hf_verifies_by_default(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ck, _, _ = _checkpoint(tmp_path)
    assert main(_to_hf(ck, tmp_path / "hf")) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("verify: max |logit difference|") and "(full)" in out[0]
    assert out[1].startswith("wrote ")


def test_auto_mode_goes_per_layer_when_memory_is_short(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    import tools.hf_verify as hv

    ck, _, _ = _checkpoint(tmp_path)
    monkeypatch.setattr(hv, "_available_bytes", lambda: 1000)
    assert main(_to_hf(ck, tmp_path / "hf")) == 0
    assert "(per-layer)" in capsys.readouterr().out


def test_per_layer_mode_holds_one_layer_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The memory bound of --verify per-layer: whenever a transformers layer runs, every other layer
    of the model is still (or again) on the meta device, holding no memory."""
    import tools.hf_verify as hv

    ck, _, _ = _checkpoint(tmp_path, num_layers=4)
    real_counts: list[int] = []
    original = hv.layer_loader

    def spying_loader(model, files):  # type: ignore[no-untyped-def]
        materialize, release = original(model, files)
        layers = hv.layers_of(model)

        def counted(i: int) -> None:
            materialize(i)
            real_counts.append(sum(next(x.parameters()).device.type != "meta" for x in layers))

        return counted, release

    monkeypatch.setattr(hv, "layer_loader", spying_loader)
    assert main(_to_hf(ck, tmp_path / "hf", "--verify", "per-layer")) == 0
    assert real_counts == [1, 1, 1, 1]


@pytest.mark.parametrize("mode", ["full", "per-layer"])
@pytest.mark.parametrize("damage", ["drop", "reshape"])
def test_verification_catches_an_export_transformers_cannot_load(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    mode: str,
    damage: str,
) -> None:
    """A tensor missing from the files (transformers would initialise it at random) or of the wrong
    shape (transformers refuses the file) fails the check with one line; nothing is left."""
    from tools.hf_shards import ShardWriter

    ck, _, _ = _checkpoint(tmp_path)
    original, target = ShardWriter.add, "transformer.h.0.attn.c_attn.weight"

    def add(self: ShardWriter, name: str, tensor: torch.Tensor) -> None:
        if name != target:
            original(self, name, tensor)
        elif damage == "reshape":
            original(self, name, tensor[:, :-8])

    monkeypatch.setattr(ShardWriter, "add", add)
    err = one_line_error(main, _to_hf(ck, tmp_path / "hf", "--verify", mode), capsys)
    assert "to-hf verify:" in err and "not written" in err, err
    _no_output_left(tmp_path / "hf")
