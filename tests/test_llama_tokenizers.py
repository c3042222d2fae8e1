"""Llama-family tokenizers through mlm-convert: from-hf (tp2, vocabulary padded) -> to-hf gives a
directory whose tokenizer encodes like the source's, whose generation config keeps bos/eos/pad,
whose vocabulary padding is gone, whose logits equal the source's, and which transformers'
text-generation pipeline continues; Megatron's Llama2Tokenizer (a SentencePiece file) exports as
a Hugging Face LlamaTokenizer that adds BOS."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from mlm_eval.builtin import builtin_path
from pretrain.tokenizer.record import PROBE_TEXT
from tests.llama_fixtures import (
    qwen_style_bpe_tokenizer,
    save_llama_with_tokenizer,
    train_llama_sentencepiece,
)
from tools.convert_cli import main as convert_main

pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(train_llama_sentencepiece(tmp_path_factory.mktemp("spm") / "tokenizer.model"))


def _tokenizer(kind: str, sp_model: Path) -> Any:
    if kind == "bpe":
        return qwen_style_bpe_tokenizer()
    from tools.hf_sentencepiece import llama_tokenizer_from_sentencepiece

    return llama_tokenizer_from_sentencepiece(str(sp_model), add_bos=True)


def _inspect(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    capsys.readouterr()
    assert convert_main(["inspect", str(ckpt), "--json"]) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("kind", "case"), [("sentencepiece", "llama3"), ("bpe", "qwen2"), ("sentencepiece", "mistral")]
)
def test_from_hf_to_hf_keeps_tokenizer_generation_config_and_logits(
    tmp_path: Path, sp_model: Path, capsys: pytest.CaptureFixture[str], kind: str, case: str
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tok = _tokenizer(kind, sp_model)
    src = save_llama_with_tokenizer(tmp_path / "hf", tok, case=case)
    assert (
        convert_main(["from-hf", "--load", str(tmp_path / "hf"), "--save", str(tmp_path / "ck"), "--tp", "2"])
        == 0
    )
    info = _inspect(tmp_path / "ck", capsys)
    hf_params = sum(p.numel() for p in src.parameters())
    assert (info["vocab_size"], info["padded_vocab_size"]) == (400, 512)  # padded to 128 x tp on import
    assert info["num_parameters"] == hf_params
    argv = [
        "reshard",
        "--load",
        str(tmp_path / "ck"),
        "--save",
        str(tmp_path / "ck4"),
        "--target-tp",
        "4",
        "--target-pp",
        "1",
    ]
    assert convert_main(argv) == 0  # 2 KV groups at tp 4: K/V heads replicated in the files
    assert _inspect(tmp_path / "ck4", capsys)["num_parameters"] == hf_params  # ... and counted once
    assert convert_main(["to-hf", "--load", str(tmp_path / "ck4"), "--save", str(tmp_path / "out")]) == 0

    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["vocab_size"] == 400  # the padding is gone
    assert config["architectures"] == [type(src).__name__]  # Mistral stays Mistral
    want, got = (GenerationConfig.from_pretrained(str(d)) for d in (tmp_path / "hf", tmp_path / "out"))
    assert (got.bos_token_id, got.eos_token_id, got.pad_token_id) == (
        want.bos_token_id, want.eos_token_id, want.pad_token_id)  # fmt: skip
    before, after = (AutoTokenizer.from_pretrained(str(d)) for d in (tmp_path / "hf", tmp_path / "out"))
    wiki = builtin_path("wikitext_sample.tokens").read_text(encoding="utf-8")[:3000]
    for text in (PROBE_TEXT, wiki):
        assert after.encode(text) == before.encode(text)  # special tokens too: BOS for Llama, none for Qwen2
    assert (after.bos_token_id, after.eos_token_id, after.pad_token_id) == (
        before.bos_token_id, before.eos_token_id, before.pad_token_id)  # fmt: skip
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    ids = torch.tensor([before.encode(PROBE_TEXT)])
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, src(ids).logits, rtol=0, atol=0)


def test_text_generation_pipeline_continues_text(tmp_path: Path, sp_model: Path) -> None:
    from transformers import pipeline

    save_llama_with_tokenizer(tmp_path / "hf", _tokenizer("sentencepiece", sp_model))
    assert (
        convert_main(["from-hf", "--load", str(tmp_path / "hf"), "--save", str(tmp_path / "ck"), "--pp", "2"])
        == 0
    )
    assert convert_main(["to-hf", "--load", str(tmp_path / "ck"), "--save", str(tmp_path / "out")]) == 0
    outs = {}
    for name in ("hf", "out"):
        generate = pipeline("text-generation", model=str(tmp_path / name), device="cpu")
        outs[name] = generate("The weather was", max_new_tokens=8, do_sample=False)[0]["generated_text"]
    assert outs["out"] == outs["hf"]
    assert outs["out"].startswith("The weather was") and len(outs["out"]) > len("The weather was")


def test_megatron_llama2_tokenizer_exports_as_a_bos_adding_llama_tokenizer(
    tmp_path: Path, sp_model: Path
) -> None:
    import sentencepiece
    from transformers import AutoTokenizer, GenerationConfig

    from pretrain.tokenizer.factory import TokenizerConfig, build_tokenizer
    from tools.hf_io import export_hf, import_hf

    ours = build_tokenizer(TokenizerConfig("Llama2Tokenizer", model_path=str(sp_model)))
    sp = sentencepiece.SentencePieceProcessor(model_file=str(sp_model))
    assert (ours.bos, ours.eod, ours.pad, ours.adds_bos, ours.vocab_size) == (1, 2, None, True, 400)
    assert ours.tokenize(PROBE_TEXT) == sp.encode(PROBE_TEXT)  # no BOS from tokenize itself
    save_llama_with_tokenizer(tmp_path / "hf", _tokenizer("sentencepiece", sp_model))
    source = import_hf(tmp_path / "hf")
    export_hf(source.full.items(), source.spec, tmp_path / "out", tokenizer=ours)
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert hf.encode(PROBE_TEXT, add_special_tokens=False) == sp.encode(PROBE_TEXT)
    assert hf.encode(PROBE_TEXT) == [1, *sp.encode(PROBE_TEXT)]  # Llama's convention: BOS first
    gen = GenerationConfig.from_pretrained(str(tmp_path / "out"))
    assert (gen.bos_token_id, gen.eos_token_id) == (1, 2)
