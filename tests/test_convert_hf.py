"""mlm-convert to-hf / from-hf: GPT-2 and BERT round trips through our layouts, logits vs ours."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from pretrain.models.gpt import GPTModel
from pretrain.models.sharding import load_full_state_dict
from pretrain.parallel.state import ParallelState
from tests.convert_fixtures import write_ours
from tests.gpt_fixtures import full_weights, tiny_config
from tools.convert_cli import main

os.environ["HF_HUB_OFFLINE"] = "1"


@pytest.mark.parametrize("gelu", ["tanh", "erf"])
def test_to_hf_gpt_logits_match_ours(tmp_path: Path, gelu: str) -> None:
    from transformers import GPT2LMHeadModel

    cfg = tiny_config(num_layers=4, gelu=gelu, layernorm_epsilon=1e-6)
    full = full_weights(cfg)
    write_ours(tmp_path / "ck", cfg, full, tp=2, pp=2)
    assert (
        main(["to-hf", "--weights-only", "--load", str(tmp_path / "ck"), "--save", str(tmp_path / "hf")]) == 0
    )
    loaded: Any = GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf"), output_loading_info=True)
    hf, info = loaded
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert hf.config.vocab_size == 1003 and hf.config.layer_norm_epsilon == 1e-6
    ours = GPTModel(cfg, ParallelState.single())
    load_full_state_dict(ours, full)
    ours.eval()
    hf.eval()
    tokens = torch.randint(0, cfg.vocab_size, (3, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, ours.full_logits(ours(tokens)), atol=1e-5, rtol=0)


def _hf_round_trip(tmp_path: Path, model, *, tp: int, pp: int, vp: int = 1) -> None:
    model.save_pretrained(str(tmp_path / "src"))
    argv = ["from-hf", "--weights-only", "--load", str(tmp_path / "src"), "--save", str(tmp_path / "ck")]
    assert main([*argv, "--tp", str(tp), "--pp", str(pp), "--vp", str(vp)]) == 0
    assert main(["reshard", "--load", str(tmp_path / "ck"), "--save", str(tmp_path / "ck2"),
                 "--target-tp", "1", "--target-pp", "2", "--target-vp", "2"]) == 0  # fmt: skip
    assert (
        main(["to-hf", "--weights-only", "--load", str(tmp_path / "ck2"), "--save", str(tmp_path / "out")])
        == 0
    )
    a = load_file(str(tmp_path / "src" / "model.safetensors"))
    b = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    again = type(model).from_pretrained(str(tmp_path / "out"))
    assert again.config.to_dict()["architectures"] == [type(model).__name__]


def test_from_hf_to_hf_gpt2_round_trip_is_exact(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=1001, n_positions=32, n_embd=32, n_layer=4, n_head=4, layer_norm_epsilon=1e-5)
    _hf_round_trip(tmp_path, GPT2LMHeadModel(cfg), tp=2, pp=2)


@pytest.mark.parametrize("arch", ["BertForPreTraining", "MegatronBertForPreTraining"])
def test_from_hf_to_hf_bert_round_trip_is_exact(tmp_path: Path, arch: str) -> None:
    import transformers

    config_cls = transformers.BertConfig if arch == "BertForPreTraining" else transformers.MegatronBertConfig
    cfg = config_cls(vocab_size=1001, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=32, layer_norm_eps=1e-12)  # fmt: skip
    torch.manual_seed(0)
    _hf_round_trip(tmp_path, getattr(transformers, arch)(cfg), tp=2, pp=2)
