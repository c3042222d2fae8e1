"""MoE checkpoints converted from Hugging Face evaluate and generate as the original: ``mlm-eval``
WikiText (adjusted perplexity) on the checkpoint equals ``--hf-model`` on the original, the
tokenizer and generation config travel both ways, and KV-cache greedy generation equals
transformers' ``generate``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from mlm_eval.cli import main as eval_main
from pretrain.inference.generate import GenerationConfig, generate
from tests.llama_fixtures import qwen_style_bpe_tokenizer
from tests.moe_hf_fixtures import FAMILIES, hf_model, import_state, our_model
from tools.convert_cli import main as convert_main

pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
WIKI = ["wikitext103", "--data", "builtin:wikitext_sample.tokens", "--seq-length", "32", "--overlap", "8",
        "--method", "paper"]  # fmt: skip
PROMPTS = [[5, 17, 30, 2], [9], [44, 45, 46, 47, 48, 49, 50]]


def _eval(source: list[str], out: Path) -> dict[str, Any]:
    assert eval_main([*WIKI, *source, "--out", str(out), "--no-progress"]) == 0
    return json.loads(out.read_text())  # type: ignore[no-any-return]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_moe", "olmoe"])
def test_eval_of_converted_checkpoint_equals_hf_model(
    tmp_path: Path, family: str, capsys: pytest.CaptureFixture[str]
) -> None:
    tok = qwen_style_bpe_tokenizer()
    model = hf_model(family, vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                     pad_token_id=tok.pad_token_id, max_position_embeddings=256)  # fmt: skip
    model.save_pretrained(tmp_path / "hf")
    tok.save_pretrained(tmp_path / "hf")
    assert convert_main(["from-hf", "--load", str(tmp_path / "hf"), "--save", str(tmp_path / "ck"),
                         "--tp", "2", "--pp", "2"]) == 0  # fmt: skip
    want = _eval(["--hf-model", str(tmp_path / "hf")], tmp_path / "hf.json")["metrics"]
    got = _eval(["--ckpt", str(tmp_path / "ck")], tmp_path / "ck.json")["metrics"]
    for key in ("adjusted_ppl", "token_ppl"):
        assert got[key] == pytest.approx(want[key], rel=1e-6), key
    _generate_equals_transformers(tmp_path / "ck", model, tok, capsys)
    assert convert_main(["to-hf", "--load", str(tmp_path / "ck"), "--save", str(tmp_path / "out")]) == 0
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "out" / name).is_file(), name
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["eos_token_id"] == tok.eos_token_id


def _generate_equals_transformers(ckpt: Path, hf: Any, tok: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """``mlm-generate --ckpt`` (KV cache) on the converted checkpoint: transformers' greedy tokens."""
    from mlm_eval.generation.cli import main as generate_main

    prompt = "the quick brown fox"
    capsys.readouterr()
    assert generate_main(["--ckpt", str(ckpt), "--prompt", prompt, "--max-new-tokens", "8", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
    with torch.no_grad():
        ref = hf.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.eos_token_id)
    want = ref[0, ids.shape[1] :].tolist()
    assert got["tokens"] == (want[: want.index(tok.eos_token_id)] if tok.eos_token_id in want else want)


@pytest.mark.parametrize("family", FAMILIES)
def test_kv_cache_greedy_equals_transformers_generate(family: str) -> None:
    hf = hf_model(family)
    cfg, full = import_state(family, hf)
    ours = our_model(cfg, full)
    eos = hf.config.eos_token_id
    got = generate(ours, PROMPTS, GenerationConfig(max_new_tokens=12, use_cache=True, eos_id=eos))
    for prompt, tokens in zip(PROMPTS, got, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=eos)
        ref_new = ref[0, len(prompt) :].tolist()
        assert tokens == (ref_new[: ref_new.index(eos)] if eos in ref_new else ref_new)
