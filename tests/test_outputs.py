"""The data tools check their outputs before any work, follow the umask, and read text in one line."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from pretrain.data.builtin import builtin_corpus_path
from pretrain.utils.errors import UserError
from pretrain.utils.outputs import check_writable_output
from tests.cli_helpers import one_line_error
from tools.dedup import main as dedup_main
from tools.filter_docs import main as filter_main
from tools.preprocess import main as preprocess_main

_fails = one_line_error


def test_check_writable_output_rules(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    assert check_writable_output(tmp_path / "new" / "deeper" / "x.json", kind="file", flag="--out")
    assert check_writable_output(tmp_path / "new" / "dir", kind="dir", flag="--save")
    for path, kind, needle in ((tmp_path, "file", "is a directory"), (tmp_path / "f", "dir", "is a file"),
                               (tmp_path / "f" / "x", "file", "is not a directory")):  # fmt: skip
        with pytest.raises(UserError, match=needle):
            check_writable_output(path, kind=kind, flag="--x")  # type: ignore[arg-type]
    assert not list(tmp_path.glob(".mlm-write-probe*"))  # the probe leaves nothing behind


@pytest.fixture()
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "in.jsonl"
    path.write_text(
        "".join(json.dumps({"id": str(i), "text": f"document {i} " * 20}) + "\n" for i in range(5))
    )
    return path


def test_dedup_and_filter_refuse_unwritable_outputs_first(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file").write_text("x")
    bad = tmp_path / "file" / "out.jsonl"
    err = _fails(dedup_main, ["--input", str(corpus), "--output", str(bad), "--quiet"], capsys)
    assert err.startswith(f"error: --output {bad}:")
    err = _fails(filter_main, ["--input", str(corpus), "--output", str(tmp_path / "o.jsonl"), "--report", str(bad),
                               "--min-tokens", "2", "--quiet"], capsys)  # fmt: skip
    assert err.startswith(f"error: --report {bad}:")


def test_preprocess_refuses_unwritable_prefix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("x")
    argv = ["--input", str(builtin_corpus_path()), "--output-prefix", str(tmp_path / "file" / "sub" / "c"),
            "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", str(tmp_path / "vocab.txt")]  # fmt: skip
    assert "--output-prefix" in _fails(preprocess_main, argv, capsys)


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_dedup_outputs_follow_the_umask(corpus: Path, tmp_path: Path, mask: int) -> None:
    old = os.umask(mask)
    try:
        assert dedup_main(["--input", str(corpus), "--output", str(tmp_path / "o.jsonl"), "--quiet"]) == 0
    finally:
        os.umask(old)
    for name in ("o.jsonl", "o.removed.jsonl"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o666 & ~mask


def test_non_utf8_exclude_titles_is_one_line(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    titles = tmp_path / "titles.txt"
    titles.write_bytes(b"Du Fu\nCaf\xe9 Society\n")
    argv = [
        "--input",
        str(corpus),
        "--output",
        str(tmp_path / "o.jsonl"),
        "--exclude-titles",
        str(titles),
        "--quiet",
    ]
    err = _fails(filter_main, argv, capsys)
    assert f"--exclude-titles {titles}: line 2: byte 0xe9" in err
