"""The tokenizer from-hf carries is the one ``AutoTokenizer`` resolves for the source (issue 25 item 3).

Each family's Hugging Face directory has a ``tokenizer_config.json`` naming no class, so
transformers picks the class from ``config.json``'s ``model_type``: for Qwen2/Qwen3 that is
``Qwen2Tokenizer``, which splits digits and sets pad, neither of which is in the directory's own
``tokenizer.json``. After from-hf, ``inspect`` is consistent, the checkpoint's tokenizer encodes
like the source's, and ``mlm-eval --ckpt`` equals ``mlm-eval --hf-model`` on WikiText.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from mlm_eval.builtin import builtin_path
from mlm_eval.cli import main as eval_main
from pretrain.checkpoint.opener import open_checkpoint
from pretrain.tokenizer.loader import resolve_tokenizer
from tests.llama_fixtures import hf_model, train_llama_sentencepiece
from tools.convert_cli import main as convert_main

pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

WIKI = ["--data", "builtin:wikitext_sample.tokens", "--seq-length", "32", "--overlap", "8"]


def drop_tokenizer_class(directory: Path) -> None:
    """Make ``tokenizer_config.json`` name no class (transformers then goes by ``config.json``)."""
    path = directory / "tokenizer_config.json"
    cfg = json.loads(path.read_text(encoding="utf-8"))
    cfg.pop("tokenizer_class", None)
    path.write_text(json.dumps(cfg), encoding="utf-8")


def plain_bpe_tokenizer() -> Any:
    """A byte-level BPE ``tokenizer.json`` (eos ``<|endoftext|>``, no pad, digits not split)."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    from tests.eval_helpers import sample_corpus

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        sample_corpus(), vocab_size=400, min_frequency=2, special_tokens=["<|endoftext|>"]
    )
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>")


def build_family(family: str, directory: Path, tiny_gpt2_dir: Path) -> Path:
    """A tiny HF causal LM of ``family`` and its tokenizer, saved with no tokenizer class named."""
    import shutil

    if family == "gpt2":
        shutil.copytree(tiny_gpt2_dir, directory)
    else:
        if family in ("llama3", "mistral"):
            from tools.hf_sentencepiece import llama_tokenizer_from_sentencepiece

            spm = train_llama_sentencepiece(directory.parent / f"{family}.model")
            tok = llama_tokenizer_from_sentencepiece(str(spm), add_bos=True)
        else:
            tok = plain_bpe_tokenizer()
        model = hf_model(family, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, max_position_embeddings=64)  # fmt: skip
        model.save_pretrained(directory)
        tok.save_pretrained(directory)
    drop_tokenizer_class(directory)
    return directory


def _eval(argv: list[str], out: Path) -> dict[str, Any]:
    assert eval_main([*argv, "--out", str(out), "--no-progress"]) == 0
    return json.loads(out.read_text())  # type: ignore[no-any-return]


@pytest.mark.parametrize("family", ["gpt2", "llama3", "mistral", "qwen2", "qwen3"])
def test_ckpt_equals_hf_model_for_every_family(
    family: str, tmp_path: Path, tiny_gpt2_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    hf = build_family(family, tmp_path / "hf", tiny_gpt2_dir)
    source = AutoTokenizer.from_pretrained(str(hf))
    if family.startswith("qwen"):  # the fixture reproduces the bug: only the class splits digits
        bare = PreTrainedTokenizerFast(tokenizer_file=str(hf / "tokenizer.json"))
        assert source.encode("in 1995") != bare.encode("in 1995")
        assert type(source).__name__ == "Qwen2Tokenizer" and source.pad_token_id is not None
    ck = tmp_path / "ck"
    assert convert_main(["from-hf", "--load", str(hf), "--save", str(ck), "--tp", "2"]) == 0
    capsys.readouterr()
    assert convert_main(["inspect", str(ck), "--json"]) == 0, capsys.readouterr().out
    reader = open_checkpoint(ck)
    resolved = resolve_tokenizer(reader)
    assert resolved is not None
    wiki = builtin_path("wikitext_sample.tokens").read_text(encoding="utf-8")[:3000]
    assert resolved.tokenizer.tokenize(wiki) == source.encode(wiki, add_special_tokens=False)
    assert resolved.tokenizer.pad == source.pad_token_id
    again = tmp_path / "ck1"  # reshard accepts it (it refused the special ids before)
    assert convert_main(["reshard", "--load", str(ck), "--save", str(again), "--target-tp", "1",
                         "--target-pp", "1"]) == 0  # fmt: skip
    ours = _eval(["wikitext103", "--ckpt", str(again), *WIKI], tmp_path / "ck.json")
    theirs = _eval(["wikitext103", "--hf-model", str(hf), *WIKI], tmp_path / "hf.json")
    assert ours["metrics"]["num_tokens"] == theirs["metrics"]["num_tokens"]
    assert ours["metrics"]["adjusted_ppl"] == pytest.approx(theirs["metrics"]["adjusted_ppl"], rel=1e-6)
    assert ours["model"]["tokenizer"]["forced"] == []


def test_bert_checkpoint_tokenizer_encodes_as_the_source(tiny_bert_dir: Path, tmp_path: Path) -> None:
    """BERT (no mlm-eval: bidirectional) still carries the tokenizer AutoTokenizer resolves."""
    import shutil

    from transformers import AutoTokenizer

    hf = tmp_path / "hf"
    shutil.copytree(tiny_bert_dir, hf)
    drop_tokenizer_class(hf)
    source = AutoTokenizer.from_pretrained(str(hf))
    assert convert_main(["from-hf", "--load", str(hf), "--save", str(tmp_path / "ck")]) == 0
    resolved = resolve_tokenizer(open_checkpoint(tmp_path / "ck"))
    assert resolved is not None
    text = "The Quick brown fox, 1995."
    assert resolved.tokenizer.tokenize(text) == source.encode(text, add_special_tokens=False)


def _report_cell(results: Path, out: Path, key: str) -> tuple[dict[str, Any], str]:
    assert eval_main(["report", "--results", str(results), "--out", str(out)]) == 0
    (row,) = json.loads((out / "leaderboard.json").read_text())["rows"]
    return row["cells"][key], (out / "leaderboard.md").read_text(encoding="utf-8")


def test_report_marks_a_forced_tokenizer_result(tmp_path: Path, tiny_gpt2_dir: Path) -> None:
    """A ``--force-tokenizer`` result says so in its record and its report row (never ranked); the
    same weights' result with their own tokenizer is shown before it."""
    from pretrain.tokenizer.train_tiny import train_tiny_gpt2_bpe

    ck = tmp_path / "ck"
    assert convert_main(["from-hf", "--load", str(tiny_gpt2_dir), "--save", str(ck)]) == 0
    other = str(train_tiny_gpt2_bpe(tmp_path / "other", vocab_size=300))
    results, key = tmp_path / "results", "wikitext103:adjusted_ppl"
    forced = _eval(["wikitext103", "--ckpt", str(ck), "--tokenizer-dir", other, "--force-tokenizer", *WIKI],
                   results / "forced.json")  # fmt: skip
    assert forced["model"]["tokenizer"]["forced"]
    cell, md = _report_cell(results, tmp_path / "r1", key)
    assert "forced tokenizer" in cell["marks"] and not cell["best"]
    assert "[sample data, forced tokenizer]" in md and "Mark 'forced tokenizer'" in md
    own = _eval(["wikitext103", "--ckpt", str(ck), *WIKI], results / "own.json")
    cell, _ = _report_cell(results, tmp_path / "r2", key)
    assert "forced tokenizer" not in cell["marks"]
    assert cell["text"] == _report_text(own["metrics"]["adjusted_ppl"])
    assert [v["what"] for v in cell["variants"]] == ["float32, forced tokenizer"]


def _report_text(value: float) -> str:
    from mlm_eval.report.columns import format_value

    return format_value(value, percent=False)
