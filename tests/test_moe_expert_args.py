"""No silent expert loss (issue 27): an expert count or top-k that disagrees between a checkpoint's
Megatron ``args``, our model record beside them, and the run or conversion reading it is refused
with one line, exit 2, before any work and with nothing written; so is resharding a checkpoint
whose router is all zeros."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from pretrain.checkpoint.legacy.layout import MODEL_FILE
from pretrain.parallel.config import ParallelConfig
from tests.cli_helpers import one_line_error
from tests.test_moe_mcore_formats import moe_cfg, random_full, write_moe
from tools.convert_cli import main as convert


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One MoE checkpoint (4 experts, top-2) in both formats: legacy EP 2 files and torch_dist."""
    root = tmp_path_factory.mktemp("moe_args")
    cfg = moe_cfg(num_layers=2)
    legacy = write_moe(root / "legacy", cfg, random_full(cfg), ParallelConfig(tp=1, pp=1, ep=2))
    argv = ["reshard", "--load", str(legacy), "--save", str(root / "dist"), "--target-tp", "1",
            "--target-pp", "1", "--target-ep", "2", "--ckpt-format", "torch_dist"]  # fmt: skip
    assert convert(argv) == 0
    return {"legacy": legacy, "dist": root / "dist"}


def _edit_args(root: Path, fmt: str, field: str, value: int) -> None:
    """Megatron's ``args.<field>`` changed in every file that holds ``args`` (our record kept)."""
    files = root.glob(f"iter_*/*/{MODEL_FILE}") if fmt == "legacy" else root.glob("iter_*/common.pt")
    for path in files:
        state = torch.load(path, weights_only=False)
        setattr(state["args"], field, value)
        torch.save(state, path)


@pytest.mark.parametrize("fmt", ["legacy", "dist"])
@pytest.mark.parametrize(("field", "value"), [("num_experts", 8), ("moe_router_topk", 3)])
def test_args_disagreeing_with_the_model_record_are_refused(
    saved: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    fmt: str,
    field: str,
    value: int,
) -> None:
    root = tmp_path / "ck"
    shutil.copytree(saved[fmt], root)
    _edit_args(root, fmt, field, value)
    save = tmp_path / "out"
    for command in ("reshard", "to-hf"):
        argv = [command, "--load", str(root), "--save", str(save)]
        argv += ["--target-tp", "1", "--target-pp", "1"] if command == "reshard" else ["--weights-only"]
        err = one_line_error(convert, argv, capsys)
        assert f"args.{field} is {value} but the model record (args.mlm_toolkit.model) says" in err, err
        assert not save.exists()


def test_unedited_args_agree(saved: dict[str, Path], tmp_path: Path) -> None:
    for fmt, root in saved.items():
        argv = ["reshard", "--load", str(root), "--save", str(tmp_path / fmt), "--target-tp", "1",
                "--target-pp", "1"]  # fmt: skip
        assert convert(argv) == 0


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        ({"moe-router-topk": 1}, "moe-router-topk 2 (checkpoint) vs 1 (this run)"),
        ({"num-experts": 8}, "num-experts 4 (checkpoint) vs 8 (this run)"),
        ({"num-experts": None, "moe-router-topk": None, "moe-ffn-hidden-size": None}, "num-experts 4 (checkpoint) vs None"),
    ],
)  # fmt: skip
def test_resume_with_another_expert_count_or_topk_is_refused(
    gpt_data: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: dict[str, object],
    words: str,
) -> None:  # fmt: skip
    """The same tensors under another top-k are another function: resuming is refused, not retrained."""
    from pretrain.training.cli import main as pretrain_main
    from tests.test_moe_ep import MOE_FLAGS
    from tests.train_fixtures import gpt_args

    one = {**MOE_FLAGS, "expert-model-parallel-size": 1, "use-distributed-optimizer": False}
    assert pretrain_main(gpt_args(gpt_data, **{**one, "train-iters": 1, "save": tmp_path / "ck"})) == 0  # type: ignore[arg-type]
    capsys.readouterr()
    before = sorted(p.name for p in (tmp_path / "ck").iterdir())
    argv = gpt_args(
        gpt_data, **{**one, **flags, "train-iters": 2, "load": tmp_path / "ck", "save": tmp_path / "ck"}
    )  # type: ignore[arg-type]
    err = one_line_error(pretrain_main, argv, capsys)
    assert "the checkpoint's architecture differs from this run's model" in err and words in err, err
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == before  # nothing written


def test_reshard_refuses_a_zeroed_router(
    saved: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "ck"
    shutil.copytree(saved["legacy"], root)
    for path in root.glob(f"iter_*/*/{MODEL_FILE}"):  # the router is in every EP rank's file
        state = torch.load(path, weights_only=False)
        state["model"]["decoder.layers.1.mlp.router.weight"].zero_()
        torch.save(state, path)
    save = tmp_path / "out"
    argv = ["reshard", "--load", str(root), "--save", str(save), "--target-tp", "2", "--target-pp", "1"]
    err = one_line_error(convert, argv, capsys)
    assert f"{root}: language_model.encoder.layers.1.mlp.router.weight is all zeros" in err, err
    assert not save.exists()
