"""mlm-convert at its edges: outputs and flags checked before work, a failed --verify keeps nothing
and announces nothing, outputs follow the umask."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

import pretrain.checkpoint.verify as verify_module
from pretrain.utils.errors import UserError
from tests.cli_helpers import help_output_and_heavy_imports, one_line_error, truncated_weights_copy
from tests.convert_fixtures import write_ours
from tests.gpt_fixtures import full_weights, tiny_config
from tools.convert_cli import main as convert_main


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = tiny_config()
    return write_ours(tmp_path_factory.mktemp("conv") / "ck", cfg, full_weights(cfg), tp=1, pp=1)


def _fails(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    return one_line_error(convert_main, argv, capsys)


def test_unwritable_save_and_bad_flags_are_refused_first(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file").write_text("x")
    bad = tmp_path / "file" / "out"
    for cmd in (["reshard", "--target-tp", "2", "--target-pp", "1"], ["to-hf"]):
        err = _fails([*cmd, "--load", str(ckpt), "--save", str(bad)], capsys)
        assert err.startswith(f"error: --save {bad}:")
    err = _fails(["reshard", "--load", str(ckpt), "--save", str(tmp_path / "r"), "--target-tp", "2",
                  "--target-pp", "1", "--verify", "--verify-tol", "-1"], capsys)  # fmt: skip
    assert "--verify-tol must be >= 0, got -1" in err
    err = _fails(
        ["to-hf", "--load", str(ckpt), "--save", str(tmp_path / "h"), "--tokenizer-dir", "/nope"], capsys
    )
    assert "--tokenizer-dir /nope: not a directory" in err
    assert not (tmp_path / "r").exists() and not (tmp_path / "h").exists()


def test_failed_verify_keeps_nothing_and_announces_nothing(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def mismatch(*args: object, **kwargs: object) -> None:
        raise UserError("logits differ by 0.5 > 0.0001")

    monkeypatch.setattr(verify_module, "verify_checkpoints", mismatch)
    out = tmp_path / "r"
    argv = [
        "reshard",
        "--load",
        str(ckpt),
        "--save",
        str(out),
        "--target-tp",
        "2",
        "--target-pp",
        "1",
        "--verify",
    ]
    assert convert_main(argv) == 1
    captured = capsys.readouterr()
    assert "wrote" not in captured.out and "differ by" in captured.err and f"removed {out}" in captured.err
    assert not out.exists()


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_resharded_checkpoint_follows_the_umask(ckpt: Path, tmp_path: Path, mask: int) -> None:
    old = os.umask(mask)
    try:
        argv = [
            "reshard",
            "--load",
            str(ckpt),
            "--save",
            str(tmp_path / "r"),
            "--target-tp",
            "2",
            "--target-pp",
            "1",
        ]
        assert convert_main(argv) == 0
    finally:
        os.umask(old)
    paths = [tmp_path / "r", *(tmp_path / "r").rglob("*")]
    for p in paths:
        want = (0o777 if p.is_dir() else 0o666) & ~mask
        assert stat.S_IMODE(p.stat().st_mode) == want, (p, oct(p.stat().st_mode))


def test_truncated_safetensors_in_from_hf_is_one_line(
    tiny_gpt2_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken, weights = truncated_weights_copy(tiny_gpt2_dir, tmp_path / "broken")
    err = _fails(["from-hf", "--load", str(broken), "--save", str(tmp_path / "ck")], capsys)
    assert f"--load {broken}: cannot read {weights}" in err and not (tmp_path / "ck").exists()


def test_help_imports_no_heavy_library() -> None:
    """``mlm-convert --help`` answers without importing torch or transformers (issue: 2.5 s)."""
    out, heavy = help_output_and_heavy_imports("tools.convert_cli", ("torch", "transformers", "safetensors"))
    assert "reshard" in out and heavy == []


def test_max_shard_size_default_is_the_exporters() -> None:
    from tools import convert_cli, hf_shards

    assert convert_cli.DEFAULT_MAX_SHARD_SIZE == hf_shards.DEFAULT_MAX_SHARD_SIZE
