"""Flags with one meaning in every command: the virtual-pipeline size."""

from __future__ import annotations

import pytest

from pretrain.utils.config_flags import virtual_pipeline_size
from pretrain.utils.errors import UserError


def test_virtual_pipeline_size_divides_or_refuses() -> None:
    assert virtual_pipeline_size(8, 2, None) == 1
    assert virtual_pipeline_size(8, 2, 2) == 2
    with pytest.raises(
        UserError, match="--num-layers 6 is not divisible by --pipeline-model-parallel-size 2 x"
    ):
        virtual_pipeline_size(6, 2, 2)  # mlm-finetune rounded this down to 1 chunk before


def test_finetune_refuses_a_virtual_stage_size_that_does_not_divide(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:  # type: ignore[no-untyped-def]
    from finetune.builtin import builtin_task_dir
    from finetune.cli import main
    from tests.finetune_fixtures import FINETUNE_WORDS, make_tiny_hf_bert

    hf = make_tiny_hf_bert(tmp_path / "hf", FINETUNE_WORDS, layers=3)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(["sst2", "--hf-model", str(hf), "--data-dir", str(builtin_task_dir("sst2_tiny")), "--pp", "1",
              "--num-layers-per-virtual-pipeline-stage", "2", "--results-dir", str(tmp_path / "r"), "--no-progress"])  # fmt: skip
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--num-layers 3 is not divisible" in err[0]
