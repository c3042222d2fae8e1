"""The weights fingerprint computed while a conversion writes (pretrain.checkpoint.deferred_fingerprint):
every output file byte for byte what the sequential path (fingerprint first) writes, for reshard,
from-hf and legacy -> torch_dist; a failing background digest fails the command and leaves nothing."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pickle
import shutil
import threading
from pathlib import Path

import pytest
import torch

import pretrain.checkpoint.deferred_fingerprint as deferred
from pretrain.checkpoint.fingerprint import weights_fingerprint
from pretrain.checkpoint.opener import open_checkpoint
from pretrain.utils.errors import UserError
from tests.convert_fixtures import write_ours
from tests.gpt_fixtures import full_weights, tiny_config
from tools.convert_cli import main as convert_main

os.environ["HF_HUB_OFFLINE"] = "1"
CFG = tiny_config(num_layers=2)


@pytest.fixture(scope="module")
def full() -> dict[str, torch.Tensor]:
    return full_weights(CFG)


def _digests(root: Path) -> dict[str, str]:
    """sha256 of every file; torch_dist's ``.metadata`` without its ``storage_meta`` (a fresh
    uuid per save, by torch's FileSystemWriter: two sequential runs differ there too)."""
    return {str(p.relative_to(root)): hashlib.sha256(_bytes(p)).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}  # fmt: skip


def _bytes(path: Path) -> bytes:
    if path.name != ".metadata":
        return path.read_bytes()
    meta = pickle.loads(path.read_bytes())
    assert meta.storage_meta is not None  # what is left out
    return pickle.dumps(dataclasses.replace(meta, storage_meta=None))


def _both_ways(monkeypatch, out: Path, argv: list[str]) -> tuple[dict[str, str], dict[str, str]]:
    """The output's file digests written with the fingerprint first, then overlapped (same path:
    the command line is recorded in the files)."""
    runs = []
    for overlap in ("0", "1"):
        monkeypatch.setenv("MLM_FINGERPRINT_OVERLAP", overlap)
        assert convert_main([*argv, "--save", str(out)]) == 0
        runs.append(_digests(out))
        shutil.rmtree(out)
    return runs[0], runs[1]


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_reshard_overlapped_writes_the_same_bytes(tmp_path: Path, full, monkeypatch, fmt: str) -> None:
    src = write_ours(tmp_path / "tp2pp2", CFG, full, tp=2, pp=2)
    argv = ["reshard", "--load", str(src), "--target-tp", "1", "--target-pp", "2", "--ckpt-format", fmt]
    seq, over = _both_ways(monkeypatch, tmp_path / "out", argv)
    assert seq == over and any(name.endswith(".pt") for name in seq)
    assert convert_main([*argv, "--save", str(tmp_path / "out")]) == 0
    meta = open_checkpoint(tmp_path / "out").metadata
    assert meta is not None and meta.provenance.weights_fingerprint == weights_fingerprint(full)


def test_from_hf_overlapped_writes_the_same_bytes(tmp_path: Path, full, monkeypatch) -> None:
    src = write_ours(tmp_path / "tp2", CFG, full, tp=2, pp=1)
    assert convert_main(["to-hf", "--weights-only", "--load", str(src), "--save", str(tmp_path / "hf")]) == 0
    argv = [
        "from-hf",
        "--weights-only",
        "--load",
        str(tmp_path / "hf"),
        "--tp",
        "2",
        "--pp",
        "2",
    ]
    seq, over = _both_ways(monkeypatch, tmp_path / "out", argv)
    assert seq == over and sum(name.endswith(".pt") for name in seq) == 4


def test_a_failing_background_fingerprint_fails_the_command_and_leaves_nothing(
    tmp_path: Path, full, monkeypatch, capsys
) -> None:
    src = write_ours(tmp_path / "tp2", CFG, full, tp=2, pp=1)

    def broken(*_a: object, **_k: object) -> str:
        raise UserError("tensor embedding.word_embeddings.weight: unreadable (planted)")

    monkeypatch.setattr(deferred, "weights_fingerprint", broken)
    monkeypatch.setenv("MLM_FINGERPRINT_OVERLAP", "1")
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        convert_main(
            ["reshard", "--load", str(src), "--save", str(out), "--target-tp", "1", "--target-pp", "1"]
        )
    assert exc.value.code == 2
    assert "planted" in capsys.readouterr().err and not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["tp2"]  # no temp directory left either


def test_patch_refuses_a_directory_without_the_placeholder(tmp_path: Path) -> None:
    torch.save({"args": "w1:" + "1" * 64}, tmp_path / "model.pt")
    with pytest.raises(UserError, match="placeholder"):
        deferred.patch_fingerprint(tmp_path, "w1:" + "2" * 64)


def test_the_fingerprint_is_digested_while_rank_files_are_written(tmp_path: Path, full, monkeypatch) -> None:
    src = write_ours(tmp_path / "tp2", CFG, full, tp=2, pp=1)
    real, seen = deferred.weights_fingerprint, []

    def waits_for_a_rank_file(source, **kw):  # noqa: ANN001, ANN202
        for _ in range(400):  # the writer runs meanwhile: a rank file appears in the temp directory
            if any(tmp_path.glob(".out*/*/mp_rank_*/*.pt")):
                seen.append(True)
                break
            threading.Event().wait(0.025)
        return real(source, **kw)

    monkeypatch.setattr(deferred, "weights_fingerprint", waits_for_a_rank_file)
    monkeypatch.setenv("MLM_FINGERPRINT_OVERLAP", "1")
    out = tmp_path / "out"
    assert (
        convert_main(
            ["reshard", "--load", str(src), "--save", str(out), "--target-tp", "1", "--target-pp", "2"]
        )
        == 0
    )
    assert seen == [True]
    meta = open_checkpoint(out).metadata
    assert meta is not None and meta.provenance.weights_fingerprint == weights_fingerprint(full)


def test_overlap_by_default_for_both_output_formats(monkeypatch) -> None:
    monkeypatch.delenv("MLM_FINGERPRINT_OVERLAP", raising=False)
    assert deferred.overlap_enabled("torch") and deferred.overlap_enabled("torch_dist")
    monkeypatch.setenv("MLM_FINGERPRINT_OVERLAP", "0")
    assert not deferred.overlap_enabled("torch") and not deferred.overlap_enabled("torch_dist")
    monkeypatch.setenv("MLM_FINGERPRINT_OVERLAP", "1")
    assert deferred.overlap_enabled("torch_dist")
