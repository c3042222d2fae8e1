"""``mlm-convert --verify``: source and target agree on a probe batch; a tampered target fails."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pretrain.checkpoint.verify import verify_against_hf
from pretrain.utils.errors import UserError
from tools.convert_cli import main as convert_main


def _tiny_gpt2(path: Path) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=301, n_positions=32, n_embd=32, n_layer=2, n_head=4, activation_function="gelu_new"
    )
    GPT2LMHeadModel(cfg).save_pretrained(path)
    return path


def _tiny_bert(path: Path) -> Path:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=301, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=32)  # fmt: skip
    BertModel(cfg).save_pretrained(path)
    return path


@pytest.mark.parametrize("make", [_tiny_gpt2, _tiny_bert])
def test_from_hf_reshard_to_hf_verify(tmp_path: Path, make, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    hf = make(tmp_path / "hf")
    assert (
        convert_main(
            [
                "from-hf",
                "--weights-only",
                "--load",
                str(hf),
                "--save",
                str(tmp_path / "a"),
                "--tp",
                "2",
                "--verify",
            ]
        )
        == 0
    )
    assert convert_main(["reshard", "--load", str(tmp_path / "a"), "--save", str(tmp_path / "b"),
                         "--target-tp", "1", "--target-pp", "2", "--verify"]) == 0  # fmt: skip
    assert (
        convert_main(
            [
                "to-hf",
                "--weights-only",
                "--load",
                str(tmp_path / "b"),
                "--save",
                str(tmp_path / "c"),
                "--verify",
            ]
        )
        == 0
    )
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("verify:")]
    assert len(lines) == 3


def test_tampered_export_fails_verification(tmp_path: Path) -> None:
    hf = _tiny_gpt2(tmp_path / "hf")
    assert convert_main(["from-hf", "--weights-only", "--load", str(hf), "--save", str(tmp_path / "a")]) == 0
    assert (
        convert_main(
            ["to-hf", "--weights-only", "--load", str(tmp_path / "a"), "--save", str(tmp_path / "c")]
        )
        == 0
    )
    weights = load_file(str(tmp_path / "c" / "model.safetensors"))
    key = next(k for k in weights if k.endswith("ln_f.weight"))
    weights[key] = weights[key] * 1.1
    save_file(weights, str(tmp_path / "c" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UserError, match="differ by"):
        verify_against_hf(tmp_path / "a", tmp_path / "c")
