"""Tests for ``mlm-filter``: short-document and title-exclusion filters, counts, atomic outputs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tools.filter_docs import FilterConfig, main, run_filter
from tools.hygiene.titles import document_title, heading_title, load_exclusions, title_key


def write_jsonl(path: Path, records: list[dict]) -> list[str]:
    lines = [json.dumps(r) + "\n" for r in records]
    path.write_text("".join(lines), encoding="utf-8")
    return lines


def read_report(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()]


def config(tmp_path: Path, **kwargs) -> FilterConfig:
    return FilterConfig(
        input=tmp_path / "in.jsonl",
        output=tmp_path / "out.jsonl",
        report=tmp_path / "rep.jsonl",
        progress=False,
        **kwargs,
    )


def test_min_tokens_whitespace_words(tmp_path: Path) -> None:
    texts = ["one two three", "a b c d e", "x\ny\tz w v u", "", "   lots   of   space   here   ok  "]
    lines = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "text": t} for i, t in enumerate(texts)])
    stats = run_filter(config(tmp_path, min_tokens=5))
    assert (stats.documents, stats.kept, stats.removed_short, stats.removed_excluded) == (5, 3, 2, 0)
    assert (tmp_path / "out.jsonl").read_text() == lines[1] + lines[2] + lines[4]
    assert read_report(tmp_path / "rep.jsonl") == [
        {"line": 1, "id": 0, "reason": "short", "tokens": 3},
        {"line": 4, "id": 3, "reason": "short", "tokens": 0},
    ]


def _save_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "a": 1, "b": 2, ",": 3}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()  # splits on \w+|[^\w\s]+
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(str(directory))


def test_min_tokens_with_tokenizer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _save_tokenizer(tmp_path / "tok")
    texts = ["a,b,a,b", "a b", "hello, world, again", "a,b c"]
    write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    stats = run_filter(config(tmp_path, min_tokens=5, tokenizer_dir=tmp_path / "tok"))
    expected = [len(re.findall(r"\w+|[^\w\s]+", t)) for t in texts]  # 7, 2, 5, 4 tokens
    assert expected == [7, 2, 5, 4]
    assert stats.kept == 2 and stats.removed_short == 2
    assert [r["tokens"] for r in read_report(tmp_path / "rep.jsonl")] == [2, 4]
    assert [json.loads(x)["text"] for x in (tmp_path / "out.jsonl").read_text().splitlines()] == [
        texts[0],
        texts[2],
    ]


def test_title_rules() -> None:
    assert (
        title_key("Kiss You ( One Direction song )")
        == title_key("Kiss You (One Direction song)")
        == "kissyouonedirectionsong"
    )
    assert title_key("Nine @-@ inch") == title_key("Nine-Inch")
    assert heading_title(" = Robert Boulter = ") == "Robert Boulter"
    assert heading_title(" = = Career = = ") is None and heading_title("plain line") is None
    assert document_title(" \n = Du Fu = \n body", None, first_line=False) == "Du Fu"
    assert document_title("Du Fu\nbody", None, first_line=False) is None
    assert document_title("Du Fu\nbody", None, first_line=True) == "Du Fu"
    assert document_title(" = Du Fu = ", "Other", first_line=False) == "Other"


def test_exclusion_file_formats(tmp_path: Path) -> None:
    wiki = tmp_path / "wiki.test.raw"
    wiki.write_text(
        " \n = Robert Boulter = \n \n Robert Boulter is an actor . \n"
        " = = Career = = \n text \n = Du Fu = \n poet \n"
    )
    assert load_exclusions(wiki) == {"robertboulter", "dufu"}
    plain = tmp_path / "titles.txt"
    plain.write_text("Robert Boulter\n\nDu Fu\nKiss You ( One Direction song )\n")
    assert load_exclusions(plain) == {"robertboulter", "dufu", "kissyouonedirectionsong"}
    # Once a file has headings, its other lines are article text, not titles.
    plain.write_text("Robert Boulter\n= Du Fu =\n")
    assert load_exclusions(plain) == {"dufu"}


def test_exclusion_and_short_counts(tmp_path: Path) -> None:
    (tmp_path / "titles.txt").write_text(
        " = Kiss You ( One Direction song ) = \n = = Release = = \n = Du Fu = \n"
    )
    records = [
        {"id": "a", "title": "Kiss You (One Direction song)", "text": "long enough text " * 5},
        {"id": "b", "title": "Release", "text": "a section name is not a title " * 3},
        {"id": "c", "text": " = Du Fu = \n Du Fu was a poet ."},  # title from the heading; also short
        {"id": "d", "text": "Du Fu\nfirst line only counts with --first-line-title " * 2},
        {"id": "e", "text": "tiny"},
        {"id": "f", "title": "Du Fu's poems", "text": "different article " * 10},
    ]
    lines = write_jsonl(tmp_path / "in.jsonl", records)
    stats = run_filter(config(tmp_path, min_tokens=8, exclude_titles=tmp_path / "titles.txt"))
    assert (stats.documents, stats.kept, stats.removed_excluded, stats.removed_short) == (6, 3, 2, 1)
    assert (tmp_path / "out.jsonl").read_text() == lines[1] + lines[3] + lines[5]
    report = read_report(tmp_path / "rep.jsonl")
    assert [(r["id"], r["reason"]) for r in report] == [("a", "excluded"), ("c", "excluded"), ("e", "short")]
    assert report[1]["title"] == "Du Fu"
    stats = run_filter(config(tmp_path, exclude_titles=tmp_path / "titles.txt", first_line_title=True))
    assert stats.removed_excluded == 3 and stats.removed_short == 0


def test_cli_counts_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_jsonl(tmp_path / "in.jsonl", [{"text": "a b c"}, {"text": "a b c d e f"}])
    argv = ["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"), "--quiet"]
    assert main([*argv, "--min-tokens", "4", "--summary", str(tmp_path / "s.json")]) == 0
    summary = json.loads((tmp_path / "s.json").read_text())
    assert (summary["kept"], summary["removed_short"]) == (1, 1)
    assert len(read_report(tmp_path / "out.dropped.jsonl")) == 1
    with pytest.raises(SystemExit) as exc:
        main(argv)  # neither filter given
    assert exc.value.code == 2 and "nothing to do" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text('{"text": "ok ok"}\nnot json\n')
    with pytest.raises(SystemExit) as exc:
        main(
            [
                "--input",
                str(tmp_path / "bad.jsonl"),
                "--output",
                str(tmp_path / "bad_out.jsonl"),
                "--min-tokens",
                "1",
            ]
        )
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "bad.jsonl:2" in err and "Traceback" not in err
    assert not (tmp_path / "bad_out.jsonl").exists() and not (tmp_path / "bad_out.dropped.jsonl").exists()
