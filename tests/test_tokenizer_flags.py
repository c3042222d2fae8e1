"""Megatron users' tokenizer files (issue 25 item 12): every command that reads a checkpoint takes
the shared tokenizer flags (``--tokenizer-type``/``--vocab-file``/``--merge-file``/
``--tokenizer-model``, or ``--tokenizer-dir``), and ``--tokenizer-dir`` finds Megatron's file names
(``gpt2-vocab.json``/``gpt2-merges.txt``). The checkpoints' ``args`` name files on a training
cluster that do not exist here."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from pretrain.checkpoint.opener import open_checkpoint
from pretrain.tokenizer.loader import load_tokenizer_dir
from tests.test_tokenizer_travel import _fails
from tools.convert_cli import main as convert_main

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
CLUSTER = "/lustre/fsw/megatron/data/gpt2"  # where the training run read its tokenizer (not here)


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tiny GPT-2 BPE as ``vocab.json``/``merges.txt`` and as Megatron's ``gpt2-*`` names."""
    from pretrain.tokenizer.train_tiny import train_tiny_gpt2_bpe

    root = tmp_path_factory.mktemp("tok")
    plain = train_tiny_gpt2_bpe(root / "plain", vocab_size=300)
    megatron = root / "megatron"
    megatron.mkdir()
    shutil.copy(plain / "vocab.json", megatron / "gpt2-vocab.json")
    shutil.copy(plain / "merges.txt", megatron / "gpt2-merges.txt")
    vocab = len(json.loads((plain / "vocab.json").read_text()))
    return {"plain": plain, "megatron": megatron, "vocab": vocab}


@pytest.fixture(scope="module")
def upstream(tok: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A legacy upstream checkpoint (no vocab_size in args) naming the cluster's tokenizer files."""
    from tests.convert_fixtures import rewrite_upstream, upstream_args, write_ours
    from tests.gpt_fixtures import full_weights, tiny_config

    cfg = tiny_config(vocab_size=tok["vocab"], max_position_embeddings=64)
    ck = write_ours(tmp_path_factory.mktemp("up") / "ck", cfg, full_weights(cfg), tp=1, pp=1)
    args = upstream_args(cfg, tp=1, pp=1)
    args.padded_vocab_size = 384
    args.vocab_file, args.merge_file = f"{CLUSTER}/gpt2-vocab.json", f"{CLUSTER}/gpt2-merges.txt"
    rewrite_upstream(ck, cfg, version=3.0, era="legacy", args=args)
    return ck


def test_flags_name_local_copies_of_the_cluster_files(
    upstream: Path, tok: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert not open_checkpoint(upstream).info.vocab_known  # the args' files are not here
    line = _fails(capsys, convert_main, ["to-hf", "--load", str(upstream), "--save", str(tmp_path / "no")])
    assert "no usable tokenizer" in line
    files = [
        "--vocab-file",
        str(tok["plain"] / "vocab.json"),
        "--merge-file",
        str(tok["plain"] / "merges.txt"),
    ]
    capsys.readouterr()
    assert convert_main(["inspect", str(upstream), "--json", *files]) == 0  # the type: args.tokenizer_type
    record = json.loads(capsys.readouterr().out)
    assert record["vocab_known"] and record["vocab_size"] == tok["vocab"]
    assert record["tokenizer"]["source"].startswith("--tokenizer-type GPT2BPETokenizer --vocab-file")
    hf = tmp_path / "hf"
    assert convert_main(["to-hf", "--load", str(upstream), "--save", str(hf), "--tokenizer-type",
                         "GPT2BPETokenizer", *files]) == 0  # fmt: skip
    assert json.loads((hf / "config.json").read_text())["vocab_size"] == tok["vocab"]
    new = tmp_path / "tp2"
    assert convert_main(["reshard", "--load", str(upstream), "--save", str(new), "--target-tp", "2",
                         "--target-pp", "1", *files]) == 0  # fmt: skip
    capsys.readouterr()
    assert convert_main(["inspect", str(new), "--json"]) == 0  # it carries the tokenizer now
    assert json.loads(capsys.readouterr().out)["tokenizer"]["source"] == "the checkpoint's tokenizer"


def test_tokenizer_dir_finds_megatron_file_names(
    upstream: Path, tok: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    found = load_tokenizer_dir(tok["megatron"])
    assert found.tokenizer_type == "GPT2BPETokenizer" and found.vocab_size == tok["vocab"]
    hf = tmp_path / "hf"
    assert convert_main(["to-hf", "--load", str(upstream), "--save", str(hf), "--tokenizer-dir",
                         str(tok["megatron"])]) == 0  # fmt: skip
    assert (hf / "tokenizer.json").is_file()
    line = _fails(capsys, convert_main, ["to-hf", "--load", str(upstream), "--save", str(tmp_path / "x"),
                                         "--tokenizer-dir", str(tok["megatron"]), "--vocab-file",
                                         str(tok["plain"] / "vocab.json")])  # fmt: skip
    assert "--tokenizer-dir" in line and "--vocab-file" in line


def test_bad_tokenizer_flags_are_one_line(
    upstream: Path, tok: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = _fails(
        capsys, convert_main, ["inspect", str(upstream), "--vocab-file", f"{CLUSTER}/gpt2-vocab.json"]
    )
    assert line == f"error: --vocab-file {CLUSTER}/gpt2-vocab.json: no such file"
    line = _fails(capsys, convert_main, ["reshard", "--load", str(upstream), "--save", str(tmp_path / "r"),
                                         "--target-tp", "1", "--target-pp", "1", "--tokenizer-type",
                                         "GPT2BPETokenizer", "--vocab-file", str(tok["plain"] / "vocab.json")])  # fmt: skip
    assert "--merge-file" in line and not (tmp_path / "r").exists()


def test_mlm_generate_takes_the_same_flags(
    upstream: Path, tok: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    from mlm_eval.generation.cli import main as generate_main

    base = ["--ckpt", str(upstream), "--prompt", "The", "--max-new-tokens", "3", "--json"]
    files = [
        "--vocab-file",
        str(tok["plain"] / "vocab.json"),
        "--merge-file",
        str(tok["plain"] / "merges.txt"),
    ]
    capsys.readouterr()
    assert generate_main([*base, "--tokenizer-type", "GPT2BPETokenizer", *files]) == 0
    by_files = json.loads(capsys.readouterr().out)
    assert generate_main([*base, "--tokenizer-dir", str(tok["megatron"])]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == by_files["tokens"]


@pytest.mark.slow
def test_megatron_core_checkpoint_with_cluster_paths_converts(tok: dict[str, Any], tmp_path: Path) -> None:
    """megatron-core 0.16 writes a checkpoint whose args name the cluster's gpt2-vocab.json /
    gpt2-merges.txt; to-hf with local copies (by flag, or a --tokenizer-dir of Megatron's names)
    gives a Hugging Face model whose logits equal megatron-core's."""
    pytest.importorskip("megatron.core")
    from transformers import AutoModelForCausalLM

    ck = tmp_path / "mcore"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "megatron_core_writer.py"), str(ck),
                           f"{CLUSTER}/gpt2-vocab.json", f"{CLUSTER}/gpt2-merges.txt", str(tok["vocab"])],
                          env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    probe = torch.load(ck / "logits.pt")
    files = [
        "--vocab-file",
        str(tok["plain"] / "vocab.json"),
        "--merge-file",
        str(tok["plain"] / "merges.txt"),
    ]
    for name, flags in (("by-files", files), ("by-dir", ["--tokenizer-dir", str(tok["megatron"])])):
        out = tmp_path / name
        assert convert_main(["to-hf", "--load", str(ck), "--save", str(out), *flags]) == 0
        model = AutoModelForCausalLM.from_pretrained(str(out)).eval()
        with torch.no_grad():
            logits = model(probe["tokens"]).logits
        torch.testing.assert_close(logits, probe["logits"], atol=1e-4, rtol=0)


def test_mlm_eval_takes_tokenizer_model(upstream: Path, tok: dict[str, Any], tmp_path: Path) -> None:
    """mlm-eval has the whole group too: ``--tokenizer-model`` names a Hugging Face tokenizer
    directory (here the to-hf export's), scoring as the BPE files do."""
    from mlm_eval.cli import main as eval_main

    files = [
        "--vocab-file",
        str(tok["plain"] / "vocab.json"),
        "--merge-file",
        str(tok["plain"] / "merges.txt"),
    ]
    hf = tmp_path / "hf"
    assert convert_main(["to-hf", "--load", str(upstream), "--save", str(hf), *files]) == 0
    data = ["--data", "builtin:lambada_sample.jsonl", "--no-progress"]
    runs = {
        "files": ["--tokenizer-type", "GPT2BPETokenizer", *files],
        "model": ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(hf)],
    }
    ppl = {}
    for name, flags in runs.items():
        out = tmp_path / f"{name}.json"
        assert eval_main(["lambada", "--ckpt", str(upstream), *flags, *data, "--out", str(out)]) == 0
        ppl[name] = json.loads(out.read_text())["metrics"]["ppl"]
    assert ppl["model"] == pytest.approx(ppl["files"], rel=1e-9)
