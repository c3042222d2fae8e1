"""Flags with one meaning in every command: the virtual-pipeline size and the shared typed flag groups
(tokenizer, dtype, parallel layout) of mlm-pretrain, mlm-eval, mlm-finetune, mlm-convert, mlm-generate
and mlm-layout."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import pytest

from pretrain.parallel.config import ParallelConfig
from pretrain.utils.config_flags import virtual_pipeline_size
from pretrain.utils.errors import UserError
from pretrain.utils.flag_groups import flag_meta


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


# ------------------------------------------------------------------ shared typed flag groups

SHARED_HELP = {  # command -> (argv for --help, flags of the shared groups it shows)
    "mlm-pretrain": (["gpt"], ["--tensor-model-parallel-size N, --tp N", "--tokenizer-type", "--bf16", "--fp16"]),
    "mlm-eval": (["lambada"], ["--tensor-model-parallel-size N, --tp N", "--tokenizer-dir DIR", "--force-tokenizer",
                               "--dtype {fp32,bf16,fp16}", "(default: fp32)"]),
    "mlm-finetune": ([], ["--tensor-model-parallel-size N, --tp N", "--tokenizer-dir DIR", "--force-tokenizer",
                          "--bf16"]),
    "mlm-convert": (["from-hf"], ["--tensor-model-parallel-size N, --tp N", "--tokenizer-dir DIR", "--vp N"]),
    "mlm-generate": ([], ["--tensor-model-parallel-size N, --tp N", "--tokenizer-type", "--vocab-file PATH",
                          "--merge-file PATH", "--tokenizer-model", "--dtype {fp32,bf16,fp16}", "(default: fp32)"]),
    "mlm-layout": ([], ["--tensor-model-parallel-size N, --tp N", "--vp N",
                        "virtual pipeline chunks per stage (VP) (default: 1)"]),
}  # fmt: skip


def _main(command: str):  # type: ignore[no-untyped-def]
    if command == "mlm-pretrain":
        from pretrain.training.cli import main
    elif command == "mlm-eval":
        from mlm_eval.cli import main
    elif command == "mlm-finetune":
        from finetune.cli import main
    elif command == "mlm-generate":
        from mlm_eval.generation.cli import main
    elif command == "mlm-layout":
        from pretrain.parallel.layout_cli import main
    else:
        from tools.convert_cli import main
    return main


@pytest.mark.parametrize("command", sorted(SHARED_HELP))
def test_every_command_help_shows_the_shared_flags_with_defaults(
    command: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    argv, shown = SHARED_HELP[command]
    with pytest.raises(SystemExit) as exc:
        _main(command)([*argv, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in shown:
        assert flag in out, (command, flag)
    assert "tensor-parallel size (TP) (default: 1)" in out
    assert "pipeline-parallel size (PP); DP = world / (TP x PP) (default: 1)" in out


def test_flag_dataclasses_round_trip_through_argparse() -> None:
    import argparse
    from pathlib import Path

    from pretrain.config import DTypeFlags
    from pretrain.parallel.config import ParallelConfig
    from pretrain.tokenizer.flags import TokenizerFlags
    from pretrain.utils.flag_groups import add_flag_group, flags_from_namespace

    parser = argparse.ArgumentParser()
    for cls in (TokenizerFlags, DTypeFlags):
        add_flag_group(parser, cls, title=cls.__name__)
    add_flag_group(parser, ParallelConfig, title="layout", include=ParallelConfig.SIZES)
    assert flags_from_namespace(ParallelConfig, parser.parse_args([])) == ParallelConfig()
    assert flags_from_namespace(TokenizerFlags, parser.parse_args([])) == TokenizerFlags()
    ns = parser.parse_args(["--tp", "2", "--pipeline-model-parallel-size", "4", "--vp", "3", "--dtype", "bf16",
                            "--bf16", "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v.json",
                            "--merge-file", "m.txt", "--tokenizer-dir", "tok", "--force-tokenizer"])  # fmt: skip
    assert flags_from_namespace(ParallelConfig, ns) == ParallelConfig(tp=2, pp=4, vp=3)
    assert flags_from_namespace(DTypeFlags, ns) == DTypeFlags(dtype="bf16", bf16=True)
    tok = flags_from_namespace(TokenizerFlags, ns)
    assert tok == TokenizerFlags(tokenizer_type="GPT2BPETokenizer", vocab_file="v.json", merge_file="m.txt",
                                 tokenizer_dir=Path("tok"), force_tokenizer=True)  # fmt: skip
    assert isinstance(tok.tokenizer_dir, Path)  # typed from the annotation
    # a command's own names for the same fields (mlm-convert reshard's target layout)
    from tools.convert_cli import TARGET_DESTS, TARGET_FLAGS

    target = argparse.ArgumentParser()
    add_flag_group(
        target,
        ParallelConfig,
        title="t",
        include=ParallelConfig.SIZES,
        flags=TARGET_FLAGS,
        dests=TARGET_DESTS,
        required=("tp", "pp"),
    )
    ns = target.parse_args(["--target-tp", "4", "--target-pp", "2"])
    assert flags_from_namespace(ParallelConfig, ns, dests=TARGET_DESTS) == ParallelConfig(tp=4, pp=2, vp=1)


@pytest.mark.parametrize(
    ("command", "argv", "flag"),
    [
        ("mlm-eval", ["lambada", "--ckpt", "x", "--tp", "two"], "--tensor-model-parallel-size/--tp"),
        ("mlm-eval", ["lambada", "--ckpt", "x", "--dtype", "fp8"], "--dtype"),
        ("mlm-convert", ["from-hf", "--load", "x", "--save", "y", "--pp", "1.5"], "--pipeline-model-parallel-size/--pp"),
        ("mlm-convert", ["reshard", "--load", "x", "--save", "y", "--target-tp", "a", "--target-pp", "1"], "--target-tp"),
        ("mlm-pretrain", ["gpt", "--tokenizer-type", "Nope"], "--tokenizer-type"),
        ("mlm-finetune", ["sst2", "--hf-model", "x", "--data-dir", "d", "--tp", "x"], "--tensor-model-parallel-size/--tp"),
        ("mlm-generate", ["--ckpt", "x", "--prompt", "p", "--pp", "two"], "--pipeline-model-parallel-size/--pp"),
        ("mlm-generate", ["--ckpt", "x", "--prompt", "p", "--dtype", "fp8"], "--dtype"),
        ("mlm-generate", ["--ckpt", "x", "--prompt", "p", "--tokenizer-type", "Nope"], "--tokenizer-type"),
        ("mlm-layout", ["--world-size", "8", "--vp", "x"], "--vp"),
        ("mlm-layout", ["--world-size", "8", "--tensor-model-parallel-size", "1.5"], "--tensor-model-parallel-size/--tp"),
    ],
)  # fmt: skip
def test_a_bad_flag_value_is_one_line_and_exit_2(
    command: str, argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        _main(command)(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error:" in err[0] and flag in err[0], err


def test_dtype_flags_name_one_dtype() -> None:
    from pretrain.config import DTypeFlags

    assert DTypeFlags().dtype_name() == "float32"
    assert DTypeFlags(bf16=True).dtype_name() == "bfloat16" == DTypeFlags(dtype="bf16").dtype_name()
    assert DTypeFlags(fp16=True).dtype_name() == "float16"
    with pytest.raises(UserError, match="--bf16 and --fp16 are mutually exclusive"):
        DTypeFlags(bf16=True, fp16=True).dtype_name()


def test_mlm_layout_reads_the_megatron_spelling_of_the_shared_flags(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import json

    from pretrain.parallel.layout_cli import main

    argv = ["--world-size", "8", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
            "--vp", "2", "--json"]  # fmt: skip
    assert main(argv) == 0
    groups = json.loads(capsys.readouterr().out)
    assert groups["tp"][0] == [0, 1] and groups["pp"][0] == [0, 4]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--hf-model", "nowhere", "--prompt", "p", "--tp", "2"], "--hf-model runs in one process"),
        (["--ckpt", "nowhere", "--prompt", "p", "--pp", "0"], "--pipeline-model-parallel-size must be >= 1"),
        (["--ckpt", "nowhere", "--prompt", "p", "--vocab-file", "v.json"], "--vocab-file needs --tokenizer-type"),
        (["--hf-model", "nowhere", "--prompt", "p", "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v.json",
          "--merge-file", "m.txt"],
         "--tokenizer-type is for --ckpt"),
    ],
)  # fmt: skip
def test_mlm_generate_acts_on_the_typed_flags_before_loading(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from mlm_eval.generation.cli import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


@dataclass(frozen=True, kw_only=True)
class _WithExperts(ParallelConfig):
    """Expert parallelism as the next issue adds it to ParallelConfig: one field, its name in SIZES."""

    SIZES: ClassVar[tuple[str, ...]] = (*ParallelConfig.SIZES, "ep")
    ep: int = field(
        default=1,
        metadata=flag_meta(
            "expert-parallel size (EP)", flags=("--expert-model-parallel-size", "--ep"), metavar="N"
        ),
    )


def test_a_new_parallel_size_is_one_field_of_the_layout() -> None:
    """The flags, their parsing and the positive-size check all follow from the layout dataclass."""
    import argparse

    from pretrain.utils.flag_groups import add_flag_group, flags_from_namespace

    parser = argparse.ArgumentParser()
    add_flag_group(parser, _WithExperts, title="layout", include=_WithExperts.SIZES)
    assert "--expert-model-parallel-size N, --ep N" in parser.format_help()
    assert "--decoder-first-pipeline-num-layers" not in parser.format_help()  # not a size
    ns = parser.parse_args(["--ep", "4", "--tp", "2"])
    assert flags_from_namespace(_WithExperts, ns) == _WithExperts(tp=2, ep=4)
    with pytest.raises(UserError, match="--ep must be a positive integer, got 0"):
        flags_from_namespace(_WithExperts, parser.parse_args(["--ep", "0"]))


def test_the_layout_derives_its_sizes() -> None:
    layout = ParallelConfig(tp=2, pp=4)
    assert layout.model_parallel_size == 8 and layout.data_parallel_size(16) == 2
    with pytest.raises(
        UserError, match=r"world size 12 is not divisible by TP 2 x PP 4 \(DP = world / \(TP x PP\)\)"
    ):
        layout.data_parallel_size(12)
    with pytest.raises(UserError, match="--vp 2 needs --pp >= 2"):
        ParallelConfig(vp=2)


def test_pretrain_and_finetune_read_the_uneven_pipeline_split_into_the_layout() -> None:
    from pretrain.training.cli import add_parallel_args, parallel_from_args
    from pretrain.utils.cli import OneLineParser

    parser = OneLineParser()
    add_parallel_args(parser)
    args = parser.parse_args(["--pp", "2", "--decoder-first-pipeline-num-layers", "3",
                              "--num-layers-per-virtual-pipeline-stage", "1"])  # fmt: skip
    assert parallel_from_args(args, num_layers=6) == ParallelConfig(pp=2, vp=3, num_layers_in_first_stage=3)
