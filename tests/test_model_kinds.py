"""The model kinds (``pretrain/models/kinds.py``): each recorded kind answers the facts code outside
the model asks, builds the model class it names, and an unknown recorded kind stops with one
``UserError`` line naming where it was read."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from pretrain.checkpoint.plan import ModelSpec, meta_chunk
from pretrain.config import ModelConfig
from pretrain.models.bert import BertModel
from pretrain.models.families import families
from pretrain.models.gpt import GPTModel
from pretrain.models.kinds import KINDS, kind_of, kind_of_config, kind_of_names
from pretrain.parallel.state import ParallelState
from pretrain.utils.errors import UserError
from tests.convert_fixtures import write_ours
from tests.gpt_fixtures import full_weights, tiny_config
from tools.convert_cli import main as convert_main

TINY = dict(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=32, max_position_embeddings=8)


def test_both_kinds_answer() -> None:
    gpt, bert = kind_of("gpt"), kind_of("bert")
    assert (gpt.causal_lm, gpt.bidirectional, gpt.has_binary_head, gpt.has_mlm_head) == (
        True,
        False,
        False,
        False,
    )
    assert (bert.causal_lm, bert.bidirectional, bert.has_binary_head, bert.has_mlm_head) == (
        False,
        True,
        True,
        True,
    )
    assert (gpt.tokentypes, bert.tokentypes) == (0, 2)
    assert (gpt.mcore_block, bert.mcore_block) == ("decoder", "encoder")
    assert (gpt.default_module_names, bert.default_module_names) == ("mcore", "legacy")
    assert (gpt.probe_output, bert.probe_output) == ("logit", "hidden-state")
    # the auto classes exist in transformers and load what the families export
    assert getattr(transformers, gpt.hf_auto_class) is transformers.AutoModelForCausalLM
    assert getattr(transformers, bert.hf_auto_class) is transformers.AutoModel
    # every registered family names a kind we know (a decoder family such as MoE is gpt)
    assert {f.kind for f in families()} <= set(KINDS)


def test_kinds_build_their_model_class() -> None:
    ps = ParallelState.single()
    assert type(kind_of("gpt").build(ModelConfig(**TINY), ps, add_binary_head=True)) is GPTModel
    bert_cfg = ModelConfig(**TINY, bidirectional=True, num_tokentypes=2)
    model = kind_of("bert").build(bert_cfg, ps, add_binary_head=False)
    assert type(model) is BertModel and not hasattr(model, "binary_head")
    chunk = meta_chunk(ModelSpec(kind="bert", cfg=bert_cfg), tp=1, pre_process=True, post_process=True,
                       layer_numbers=[0])  # fmt: skip
    assert "binary_head.weight" in dict(chunk.named_parameters())


def test_kind_from_names_and_config() -> None:
    assert kind_of_names(["language_model.encoder.layers.0.mlp.dense_h_to_4h.weight"]).name == "gpt"
    assert kind_of_names(["lm_head.dense.weight"]).name == "bert"
    assert kind_of_config(ModelConfig(**TINY)).name == "gpt"
    assert kind_of_config(ModelConfig(**TINY, bidirectional=True)).name == "bert"


def test_unknown_kind_is_one_line() -> None:
    with pytest.raises(UserError) as err:
        kind_of("t5", where="ckpt/iter_0000001")
    assert str(err.value) == "ckpt/iter_0000001: unknown model kind 't5' (expected one of gpt, bert)"
    with pytest.raises(UserError, match="^model spec: unknown model kind 'moe'"):
        ModelSpec(kind="moe", cfg=ModelConfig(**TINY))


def test_unknown_recorded_kind_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``mlm-convert inspect`` of a checkpoint recording an unknown kind: exit 2, one line."""
    cfg = tiny_config(num_layers=1)
    ckpt = write_ours(tmp_path / "ckpt", cfg, full_weights(cfg), tp=1, pp=1)
    (rank_file,) = ckpt.rglob("model_optim_rng.pt")
    state = torch.load(rank_file, weights_only=False)
    state["args"].mlm_toolkit["kind"] = "t5"
    torch.save(state, rank_file)
    with pytest.raises(SystemExit) as code:
        convert_main(["inspect", str(ckpt)])
    assert code.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith(
        "mlm_toolkit.kind: unknown model kind 't5' (expected one of gpt, bert)"
    )
