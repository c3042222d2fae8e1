"""mlm-preprocess end to end: round trip, bad lines, skip mode, workers, keys, formats, sentences."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pretrain.data.builtin import builtin_corpus_path
from pretrain.data.indexed_dataset import IndexedDataset
from pretrain.tokenizer import TokenizerConfig, build_tokenizer
from pretrain.tokenizer.train_tiny import train_tiny_gpt2_bpe, train_tiny_wordpiece
from tools.preprocess import main
from tools.preprocess_records import split_sentences


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tok")
    train_tiny_gpt2_bpe(d)
    train_tiny_wordpiece(d)
    return d


def _gpt2_args(tok_dir: Path) -> list[str]:
    return [
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        str(tok_dir / "vocab.json"),
        "--merge-file",
        str(tok_dir / "merges.txt"),
    ]


def _gpt2(tok_dir: Path):  # type: ignore[no-untyped-def]
    return build_tokenizer(
        TokenizerConfig(
            "GPT2BPETokenizer", vocab_file=str(tok_dir / "vocab.json"), merge_file=str(tok_dir / "merges.txt")
        )
    )


def _jsonl(path: Path, records: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_round_trip_builtin_corpus(tmp_path: Path, tok_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out" / "corpus"
    assert (
        main(
            [
                "--input",
                str(builtin_corpus_path()),
                "--output-prefix",
                str(out),
                "--append-eod",
                *_gpt2_args(tok_dir),
            ]
        )
        == 0
    )
    summary = capsys.readouterr().out.strip().splitlines()
    assert len(summary) == 1
    texts = [
        json.loads(line)["text"] for line in builtin_corpus_path().read_text(encoding="utf-8").splitlines()
    ]
    tok = _gpt2(tok_dir)
    ds = IndexedDataset(str(out) + "_text_document")
    assert ds.dtype == np.uint16
    assert ds.num_documents == len(texts) == len(ds)
    total = 0
    for i, text in enumerate(texts):
        ids = ds.get_document(i).tolist()
        assert ids[-1] == tok.eod
        assert tok.detokenize(ids[:-1]) == text
        total += len(ids)
    assert summary[0].startswith(
        f"mlm-preprocess: {len(texts)} documents, {total} tokens, 0 bad lines skipped"
    )
    assert sorted(p.name for p in out.parent.iterdir()) == [
        "corpus_text_document.bin",
        "corpus_text_document.idx",
    ]


BAD_LINES = [
    (b"{not json}\n", "invalid JSON"),
    (b'{"txt": "wrong key"}\n', "missing key 'text'"),
    (b'{"text": 17}\n', "key 'text' is not a string"),
    (b'"just a string"\n', "expected a JSON object"),
    (b'{"text": "caf\xe9"}\n', "invalid UTF-8"),
]


@pytest.mark.parametrize(("bad", "reason"), BAD_LINES)
def test_bad_line_fails_with_file_and_line(
    tmp_path: Path, tok_dir: Path, capsys: pytest.CaptureFixture[str], bad: bytes, reason: str
) -> None:
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'{"text": "good one"}\n\n{"text": "good two"}\n' + bad + b'{"text": "good three"}\n')
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    for workers in ("1", "2") if reason == "invalid UTF-8" else ("1",):  # a pool start costs ~1.5 s
        with pytest.raises(SystemExit) as exc:
            main(
                [
                    "--input",
                    str(src),
                    "--output-prefix",
                    str(out_dir / "x"),
                    "--workers",
                    workers,
                    *_gpt2_args(tok_dir),
                ]
            )
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert f"error: {src}:4: {reason}" in err
        assert list(out_dir.iterdir()) == []  # nothing written, not even temporaries
    # Output directories the run created are removed again.
    with pytest.raises(SystemExit):
        main(
            [
                "--input",
                str(src),
                "--output-prefix",
                str(tmp_path / "new" / "deeper" / "x"),
                *_gpt2_args(tok_dir),
            ]
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out"]


def test_failure_keeps_previous_outputs(tmp_path: Path, tok_dir: Path) -> None:
    src = _jsonl(tmp_path / "in.jsonl", [{"text": "first version"}])
    prefix = tmp_path / "x"
    main(["--input", str(src), "--output-prefix", str(prefix), *_gpt2_args(tok_dir)])
    before = {p.name: p.read_bytes() for p in tmp_path.glob("x_*")}
    src.write_text('{"text": "new"}\n{"oops": 1}\n', encoding="utf-8")
    with pytest.raises(SystemExit):
        main(["--input", str(src), "--output-prefix", str(prefix), *_gpt2_args(tok_dir)])
    assert {p.name: p.read_bytes() for p in tmp_path.glob("x_*")} == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_skip_bad_lines_counts_and_reports(
    tmp_path: Path, tok_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "in.jsonl"
    lines = [b'{"text": "good one"}\n'] + [bad for bad, _ in BAD_LINES] + [b'{"text": "good two"}\n']
    src.write_bytes(b"".join(lines))
    prefix = tmp_path / "x"
    assert (
        main(["--input", str(src), "--output-prefix", str(prefix), "--skip-bad-lines", *_gpt2_args(tok_dir)])
        == 0
    )
    captured = capsys.readouterr()
    for lineno, (_, reason) in enumerate(BAD_LINES, start=2):
        assert f"warning: {src}:{lineno}: {reason}" in captured.err
    assert "2 documents" in captured.out and f"{len(BAD_LINES)} bad lines skipped" in captured.out
    tok = _gpt2(tok_dir)
    ds = IndexedDataset(str(prefix) + "_text_document")
    assert [tok.detokenize(ds.get_document(i).tolist()) for i in range(ds.num_documents)] == [
        "good one",
        "good two",
    ]


def test_all_lines_bad_is_an_error(tmp_path: Path, tok_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"{bad\n")
    with pytest.raises(SystemExit) as exc:
        main(
            [
                "--input",
                str(src),
                "--output-prefix",
                str(tmp_path / "x"),
                "--skip-bad-lines",
                *_gpt2_args(tok_dir),
            ]
        )
    assert exc.value.code == 2
    assert "no documents (1 bad lines skipped)" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def test_workers_give_identical_output(tmp_path: Path, tok_dir: Path) -> None:
    outputs = []
    for workers in (1, 2):
        prefix = tmp_path / f"w{workers}"
        args = ["--input", str(builtin_corpus_path()), "--output-prefix", str(prefix), "--append-eod"]
        assert main([*args, "--workers", str(workers), *_gpt2_args(tok_dir)]) == 0
        outputs.append(
            (
                Path(f"{prefix}_text_document.bin").read_bytes(),
                Path(f"{prefix}_text_document.idx").read_bytes(),
            )
        )
    assert outputs[0] == outputs[1]


def test_several_json_keys(tmp_path: Path, tok_dir: Path) -> None:
    src = _jsonl(
        tmp_path / "in.jsonl",
        [
            {"title": "Weather", "text": "It was sunny."},
            {"title": "Sums", "text": "2 plus 2 equals 4.", "x": 1},
        ],
    )
    prefix = tmp_path / "multi"
    main(
        [
            "--input",
            str(src),
            "--output-prefix",
            str(prefix),
            "--json-keys",
            "text",
            "title",
            *_gpt2_args(tok_dir),
        ]
    )
    tok = _gpt2(tok_dir)
    text = IndexedDataset(f"{prefix}_text_document")
    title = IndexedDataset(f"{prefix}_title_document")
    assert [tok.detokenize(text[i].tolist()) for i in range(2)] == ["It was sunny.", "2 plus 2 equals 4."]
    assert [tok.detokenize(title[i].tolist()) for i in range(2)] == ["Weather", "Sums"]


def test_plain_text_formats(tmp_path: Path, tok_dir: Path) -> None:
    tok = _gpt2(tok_dir)
    lines = tmp_path / "docs.txt"
    lines.write_text("first document\n\nsecond document\r\nthird\n", encoding="utf-8")
    main(["--input", str(lines), "--output-prefix", str(tmp_path / "lines"), *_gpt2_args(tok_dir)])
    ds = IndexedDataset(tmp_path / "lines_text_document")
    assert [tok.detokenize(ds[i].tolist()) for i in range(len(ds))] == [
        "first document",
        "second document",
        "third",
    ]

    blocks = tmp_path / "blocks.txt"
    blocks.write_text("para one\nstill one\n\n\npara two\n", encoding="utf-8")
    main(
        ["--input", str(blocks), "--output-prefix", str(tmp_path / "blocks"), "--input-format", "text-blocks"]
        + _gpt2_args(tok_dir)
    )
    ds = IndexedDataset(tmp_path / "blocks_text_document")
    assert [tok.detokenize(ds[i].tolist()) for i in range(len(ds))] == ["para one\nstill one", "para two"]

    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"fine\n\xff\xfe broken\n")
    with pytest.raises(SystemExit):
        main(["--input", str(bad), "--output-prefix", str(tmp_path / "bad"), *_gpt2_args(tok_dir)])


def test_split_sentences_for_bert(tmp_path: Path, tok_dir: Path) -> None:
    src = _jsonl(
        tmp_path / "in.jsonl",
        [{"text": "Mr. Smith went home. He was tired! Was he hungry? Yes."}, {"text": ""}, {"text": "One."}],
    )
    prefix = tmp_path / "bert"
    args = ["--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", str(tok_dir / "vocab.txt")]
    main(["--input", str(src), "--output-prefix", str(prefix), "--split-sentences", *args])
    ds = IndexedDataset(f"{prefix}_text_sentence")
    tok = build_tokenizer(TokenizerConfig("BertWordPieceLowerCase", vocab_file=str(tok_dir / "vocab.txt")))
    assert ds.num_documents == 3
    assert ds.document_indices.tolist() == [0, 4, 4, 5]  # the empty text is an empty document
    assert [tok.detokenize(ds[i].tolist()) for i in range(4)] == [
        "mr. smith went home.",
        "he was tired!",
        "was he hungry?",
        "yes.",
    ]
    with pytest.raises(SystemExit):  # BERT has no end-of-document token
        main(["--input", str(src), "--output-prefix", str(prefix), "--append-eod", *args])


def test_sentence_splitter() -> None:
    assert split_sentences(
        'He said "Stop." Then he left. Dr. Who came at 3 p.m. today. J. R. Smith wrote 2.5 pages.'
    ) == [
        'He said "Stop."',
        "Then he left.",
        "Dr. Who came at 3 p.m. today.",
        "J. R. Smith wrote 2.5 pages.",
    ]
    assert split_sentences("one line\nstill the same sentence.\n\nNew paragraph") == [
        "one line\nstill the same sentence.",
        "New paragraph",
    ]
    assert split_sentences("   ") == []


@pytest.mark.parametrize(
    ("extra", "pattern"),
    [
        (["--workers", "0"], "--workers must be at least 1"),
        (["--json-keys", "a", "a"], "--json-keys has duplicates"),
    ],
)
def test_flag_errors(
    tmp_path: Path, tok_dir: Path, capsys: pytest.CaptureFixture[str], extra: list[str], pattern: str
) -> None:
    src = _jsonl(tmp_path / "in.jsonl", [{"text": "x"}])
    with pytest.raises(SystemExit) as exc:
        main(["--input", str(src), "--output-prefix", str(tmp_path / "o"), *extra, *_gpt2_args(tok_dir)])
    assert exc.value.code == 2
    assert pattern in capsys.readouterr().err


def test_missing_input_and_tokenizer_files(
    tmp_path: Path, tok_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main(
            [
                "--input",
                str(tmp_path / "nope.jsonl"),
                "--output-prefix",
                str(tmp_path / "o"),
                *_gpt2_args(tok_dir),
            ]
        )
    assert f"error: --input {tmp_path / 'nope.jsonl'}: file not found" in capsys.readouterr().err
    src = _jsonl(tmp_path / "in.jsonl", [{"text": "x"}])
    with pytest.raises(SystemExit):
        main(
            [
                "--input",
                str(src),
                "--output-prefix",
                str(tmp_path / "o"),
                "--tokenizer-type",
                "GPT2BPETokenizer",
            ]
            + ["--vocab-file", str(tmp_path / "v.json"), "--merge-file", str(tok_dir / "merges.txt")]
        )
    assert f"error: --vocab-file {tmp_path / 'v.json'}: GPT-2 vocab.json not found" in capsys.readouterr().err


def test_builtin_corpus_is_generated_and_small() -> None:
    from pretrain.data.builtin.generate import NUM_DOCUMENTS, corpus_jsonl

    path = builtin_corpus_path()
    assert path.read_text(encoding="utf-8") == corpus_jsonl()  # regenerate with python -m ...generate
    assert path.stat().st_size < 300_000
    texts = [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines()]
    assert len(texts) == NUM_DOCUMENTS == 300
    assert len(set(texts)) > 250 and all(10 < len(t) < 2000 for t in texts)
