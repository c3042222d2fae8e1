"""Errors send the user to something they can act on (issue #25 item 7): the missing file, not a flag
no command has; the missing data directory before flags it makes moot; the flag the user typed
(``--target-tp``, not ``--tp``); every Hugging Face family from-hf reads, in its refusal and its help."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetune.cli import main as finetune_main
from pretrain.models.families import families
from tests.cli_helpers import help_output_and_heavy_imports, one_line_error
from tests.convert_fixtures import write_ours
from tests.gpt_fixtures import full_weights, tiny_config
from tools.convert_cli import main as convert_main

HF_MODEL_TYPES = {f.model_type: f.architecture for f in families()}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = tiny_config()
    return write_ours(tmp_path_factory.mktemp("wording") / "ck", cfg, full_weights(cfg), tp=1, pp=1)


def test_torch_dist_without_common_pt_names_the_file(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dist = tmp_path / "dist"
    assert convert_main(["reshard", "--load", str(ckpt), "--save", str(dist), "--target-tp", "1",
                         "--target-pp", "1", "--ckpt-format", "torch_dist"]) == 0  # fmt: skip
    (common,) = dist.glob("iter_*/common.pt")
    common.unlink()
    capsys.readouterr()
    for argv in (
        ["inspect", str(dist)],
        ["to-hf", "--load", str(dist), "--save", str(tmp_path / "hf")],
        [
            "reshard",
            "--load",
            str(dist),
            "--save",
            str(tmp_path / "r"),
            "--target-tp",
            "1",
            "--target-pp",
            "1",
        ],
    ):
        err = one_line_error(convert_main, argv, capsys)
        assert f"{common.parent}: common.pt is missing" in err and "--hidden-size" not in err, err
    assert not (tmp_path / "hf").exists() and not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    ("target", "needle"),
    [
        (["--target-tp", "3", "--target-pp", "1"], "num_attention_heads 8 is not divisible by --target-tp 3"),
        (["--target-tp", "1", "--target-pp", "3"], "num_layers 2 is not divisible by --target-pp 3"),
        (
            ["--target-tp", "1", "--target-pp", "1", "--target-vp", "2"],
            "--target-vp 2 needs --target-pp >= 2",
        ),
    ],
)
def test_reshard_errors_name_the_target_flags(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], target: list[str], needle: str
) -> None:
    err = one_line_error(convert_main, ["reshard", "--load", str(ckpt), "--save", str(tmp_path / "o"), *target],
                         capsys)  # fmt: skip
    assert needle in err, err
    assert " --tp" not in err and " --pp" not in err and " --vp" not in err, err


def test_from_hf_unknown_model_type_lists_every_family(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hf = tmp_path / "gptj"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "gptj", "n_layer": 1}))
    err = one_line_error(convert_main, ["from-hf", "--load", str(hf), "--save", str(tmp_path / "ck")], capsys)
    assert "model_type 'gptj' is not" in err
    for model_type in HF_MODEL_TYPES:
        assert repr(model_type) in err, (model_type, err)
    assert not (tmp_path / "ck").exists()


def test_the_families_are_transformers_own() -> None:
    """Each listed model_type is one transformers knows, with the architecture we name for it."""
    import transformers
    from transformers import CONFIG_MAPPING

    for model_type, architecture in HF_MODEL_TYPES.items():
        assert model_type in CONFIG_MAPPING, model_type
        assert hasattr(transformers, architecture), architecture


def test_help_names_every_family() -> None:
    out, heavy = help_output_and_heavy_imports("tools.convert_cli", ("torch", "transformers"))
    flat = " ".join(out.split())
    assert "GPT-2 / BERT" not in flat and heavy == []
    for architecture in HF_MODEL_TYPES.values():
        assert architecture in flat, architecture


def test_finetune_missing_data_dir_comes_first(
    tiny_bert_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the tiny model has 160 positions: a --seq-length beyond them must not be the first complaint
    missing = tmp_path / "nonexist"
    long = ["--seq-length", "1000"]
    err = one_line_error(finetune_main, ["sst2", "--data-dir", str(missing), "--hf-model", str(tiny_bert_dir),
                                         *long], capsys)  # fmt: skip
    assert err == f"error: --data-dir {missing}: no such directory"
    (tmp_path / "empty").mkdir()
    err = one_line_error(finetune_main, ["sst2", "--data-dir", str(tmp_path / "empty"), "--hf-model",
                                         str(tiny_bert_dir), *long], capsys)  # fmt: skip
    assert f"--data-dir {tmp_path / 'empty'}: no sst2 files" in err and "--seq-length" not in err
