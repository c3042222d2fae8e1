"""Issue 27's round trip, through the command line as users run it, for the four MoE families:
HF -> ours (``from-hf`` tp2 pp2) -> ``reshard`` (tp1 ep4, ``torch_dist``) -> ``reshard`` (tp2 pp2 ep2,
legacy files) -> ``to-hf`` is exact. Every written tensor equals the original bit for bit, the
config (token ids included: the tokenizer travels) and generation config are the original's, and
transformers computes the same logits from both directories."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.llama_fixtures import qwen_style_bpe_tokenizer
from tests.moe_hf_fixtures import FAMILIES, hf_model, probe
from tools.convert_cli import main

pytest.importorskip("transformers")
EXPERTS = 8  # divisible by EP 4 and EP 2
COUNT_KEY = {"mixtral": "num_local_experts"}  # the others: num_experts


def _save_original(family: str, directory: Path) -> None:
    tok = qwen_style_bpe_tokenizer()
    model = hf_model(family, vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                     pad_token_id=tok.pad_token_id, **{COUNT_KEY.get(family, "num_experts"): EXPERTS})  # fmt: skip
    model.save_pretrained(str(directory))
    tok.save_pretrained(str(directory))


def _legs(tmp: Path) -> list[list[str]]:
    hf, a, b, c, out = (str(tmp / d) for d in ("hf", "a", "b", "c", "out"))
    return [
        ["from-hf", "--load", hf, "--save", a, "--tp", "2", "--pp", "2", "--verify"],
        ["reshard", "--load", a, "--save", b, "--target-tp", "1", "--target-pp", "1", "--target-ep", "4",
         "--ckpt-format", "torch_dist", "--verify"],
        ["reshard", "--load", b, "--save", c, "--target-tp", "2", "--target-pp", "2", "--target-ep", "2",
         "--verify"],
        ["to-hf", "--load", c, "--save", out, "--verify", "full"],
    ]  # fmt: skip


def _logits(directory: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32, local_files_only=True)
    with torch.no_grad():
        return model.eval()(ids).logits  # type: ignore[no-any-return]


@pytest.mark.slow  # 2.4-15 s on a 2-core host: out of the fast lane (under 2 min)
@pytest.mark.parametrize("family", FAMILIES)
def test_hf_tp2pp2_ep4_dist_tp2pp2ep2_hf_is_exact(tmp_path: Path, family: str) -> None:
    _save_original(family, tmp_path / "hf")
    for argv in _legs(tmp_path):
        assert main(argv) == 0, argv
    assert (tmp_path / "b" / "release" / "metadata.json").is_file()  # torch_dist
    assert {p.name for p in (tmp_path / "c" / "release").iterdir()} >= {
        "mp_rank_00_000_000",
        "mp_rank_01_001_001",
    }
    before, after = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("hf", "out"))
    assert any(f".experts.{EXPERTS - 1}." in n for n in before)
    assert set(after) == set(before)
    for name, t in before.items():
        assert after[name].dtype == t.dtype and torch.equal(after[name], t), name
    for config in ("config.json", "generation_config.json"):
        original, written = (json.loads((tmp_path / d / config).read_text()) for d in ("hf", "out"))
        assert written == original, config
    ids = probe(int(json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"]))
    assert torch.equal(_logits(tmp_path / "out", ids), _logits(tmp_path / "hf", ids))
