"""mlm-convert for Llama-family models: Hugging Face -> ours (tp2 pp2) -> reshard (tp4 with
replicated KV heads, then pp2 vp2) -> Hugging Face is exact, and --verify passes at every step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.llama_fixtures import HF_CASES, hf_model
from tools.convert_cli import main

pytest.importorskip("transformers")
EXPORTED_AS = {"llama3": "LlamaForCausalLM", "llama_linear_tied": "LlamaForCausalLM",
               "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_round_trip_through_every_layout_is_exact(tmp_path: Path, case: str) -> None:
    import json

    from transformers import AutoModelForCausalLM

    src = hf_model(case, num_hidden_layers=4)
    src.save_pretrained(tmp_path / "hf")
    steps = [
        ["from-hf", "--load", "hf", "--save", "ck", "--tp", "2", "--pp", "2", "--weights-only"],
        ["reshard", "--load", "ck", "--save", "ck4", "--target-tp", "4", "--target-pp", "1"],  # 2 KV groups
        [
            "reshard",
            "--load",
            "ck4",
            "--save",
            "ckv",
            "--target-tp",
            "1",
            "--target-pp",
            "2",
            "--target-vp",
            "2",
        ],
        ["to-hf", "--load", "ckv", "--save", "out", "--weights-only"],
    ]
    for argv in steps:
        paths = [str(tmp_path / a) if a in ("hf", "ck", "ck4", "ckv", "out") else a for a in argv]
        assert main([*paths, "--verify"]) == 0, argv
    before, after = (
        load_file(str(tmp_path / "hf" / "model.safetensors")),
        load_file(str(tmp_path / "out" / "model.safetensors")),
    )
    if src.config.tie_word_embeddings:
        before.pop("lm_head.weight", None)
    assert set(after) == set(before)
    for name, t in before.items():
        assert torch.equal(after[name], t), name
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == [EXPORTED_AS[case]]
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    ids = torch.randint(0, 301, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, src(ids).logits, rtol=0, atol=0)
