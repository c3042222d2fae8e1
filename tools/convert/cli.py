"""``mlm-convert``: inspect, reshard and convert Megatron-layout checkpoints.

::

    mlm-convert inspect CKPT [--json]
    mlm-convert reshard --load CKPT --save NEW --target-tp 4 --target-pp 1 [--target-vp V] [--target-ep E]
    mlm-convert to-hf --load CKPT --save HFDIR [--tokenizer-dir TOK] [--verify per-layer | --no-verify]
    mlm-convert from-hf --load HFDIR --save CKPT --tp 2 --pp 2 [--vp 2]

``CKPT`` is a checkpoint root (with ``latest_checkpointed_iteration.txt``) or one iteration
directory, written by mlm-toolkit or by Megatron-LM (legacy ``torch`` format of any era, or
``torch_dist``). Every output directory is written under a temporary sibling and renamed when
complete. User errors print one line and exit with code 2; ``inspect`` exits 1 when the
checkpoint is inconsistent. Under ``torchrun -n N`` the writing commands split the output files
among the processes (:mod:`pretrain.checkpoint.work_split`); rank 0 prints and runs ``--verify``. ``inspect``, ``reshard`` and ``to-hf`` take the shared tokenizer flags
(``--tokenizer-type``/``--vocab-file``/``--merge-file``/``--tokenizer-model`` or ``--tokenizer-dir``;
e.g. local copies of the files an upstream checkpoint's ``args`` name on its training cluster).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import shutil
import sys
from pathlib import Path

from pretrain.checkpoint.work_split import WorkSplit
from pretrain.models.families.registry import supported_architectures, supported_model_types
from pretrain.parallel.config import ParallelConfig
from pretrain.tokenizer.flags import TokenizerFlags
from pretrain.utils.cli import OneLineParser
from pretrain.utils.console import import_torch_frozen
from pretrain.utils.errors import UserError, cli_entry
from pretrain.utils.flag_groups import add_flag_group, flags_from_namespace, renamed_flag_errors
from pretrain.utils.outputs import check_writable_output
from tools.convert.from_hf import run_from_hf
from tools.convert.inspect_ckpt import run_inspect
from tools.convert.reshard import run_reshard
from tools.convert.source import source_from_args
from tools.convert.to_hf import DEFAULT_MAX_SHARD_SIZE, run_to_hf

# The command modules import the heavy modules (torch, transformers) inside the functions that use
# them, so that ``mlm-convert --help`` and flag errors answer at once.


def _iteration(text: str) -> int | str:
    if text == "release":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an iteration number or 'release', got {text!r}") from None


# reshard names its layout --target-tp/--target-pp/--target-vp (the source's layout is read from disk)
TARGET_FLAGS = {"tp": ("--target-tp",), "pp": ("--target-pp",), "vp": ("--target-vp",), "ep": ("--target-ep",),
                "etp": ("--target-etp",)}  # fmt: skip
TARGET_DESTS = {
    "tp": "target_tp",
    "pp": "target_pp",
    "vp": "target_vp",
    "ep": "target_ep",
    "etp": "target_etp",
}
LAYOUT_SIZES = (*ParallelConfig.SIZES, *ParallelConfig.EXPERT)  # what convert commands write


def _add_source(p: argparse.ArgumentParser, *, positional: bool = False) -> None:
    if positional:
        p.add_argument("load", type=Path, metavar="DIR", help="checkpoint root or iteration directory")
    else:
        p.add_argument("--load", type=Path, required=True, help="source checkpoint directory")
    p.add_argument("--iteration", type=_iteration, help="iteration to read (default: the tracker's)")
    p.add_argument("--vocab-size", type=int, help="true vocabulary size, where the checkpoint records none")
    add_flag_group(p, TokenizerFlags, title="tokenizer (default: the checkpoint's own)")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="mlm-convert", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="describe a checkpoint and check it across shards")
    _add_source(p, positional=True)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p = sub.add_parser("reshard", help="rewrite a checkpoint at another TP/PP/VP layout")
    _add_source(p)
    p.add_argument("--save", type=Path, required=True, help="new output directory")
    add_flag_group(p, ParallelConfig, title="target layout", include=LAYOUT_SIZES, flags=TARGET_FLAGS,
                   dests=TARGET_DESTS, required=("tp", "pp"))  # fmt: skip
    p.add_argument("--with-optimizer", action="store_true", help="reshard the optimizer state too")
    p.add_argument("--dist-optimizer", action="store_true",
                   help="with --ckpt-format torch_dist --with-optimizer: write the state as megatron-core's "
                        "distributed optimizer saves it (fully_reshardable), for runs with --use-distributed-optimizer")  # fmt: skip
    _add_module_names(p)
    _add_format(p)
    _add_verify(p)
    p = sub.add_parser("to-hf", help="export to a Hugging Face model directory")
    _add_source(p)
    p.add_argument("--save", type=Path, required=True, help="new Hugging Face directory")
    p.add_argument("--weights-only", action="store_true",
                   help="write no tokenizer (only for checkpoints that have none; the result is not a usable model)")  # fmt: skip
    p.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE,
                   help="largest safetensors shard, as save_pretrained (e.g. 5GB, 500MB; default 5GB)")  # fmt: skip
    p.add_argument("--lora-as", choices=("merged", "adapter"), default=None,
                   help="a LoRA checkpoint: merge the adapter into its base (default) or write a PEFT adapter")  # fmt: skip
    _add_hf_verify(p)
    p = sub.add_parser("from-hf", help=f"import a Hugging Face model directory ({supported_architectures()})")
    p.add_argument("--load", type=Path, required=True,
                   help=f"Hugging Face model directory (config.json model_type {supported_model_types()})")  # fmt: skip
    p.add_argument("--save", type=Path, required=True, help="new checkpoint directory")
    add_flag_group(p, ParallelConfig, title="parallel layout", include=LAYOUT_SIZES)
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    _add_module_names(p)
    add_flag_group(p, TokenizerFlags, title="tokenizer", include=("tokenizer_dir", "force_tokenizer"))
    p.add_argument("--weights-only", action="store_true",
                   help="accept a Hugging Face directory without a tokenizer (the checkpoint records none)")  # fmt: skip
    p.add_argument("--adapter", type=Path, default=None,
                   help="a PEFT LoRA adapter directory (adapter_config.json, adapter_model.safetensors) of --load")  # fmt: skip
    p.add_argument("--adapter-as", choices=("lora", "merged"), default="lora",
                   help="keep the adapter as our LoRA checkpoint naming --load as its base (default), or merge it")  # fmt: skip
    _add_format(p)
    _add_verify(p)
    return parser


def _add_format(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ckpt-format", choices=("torch", "torch_dist"), default="torch",
                   help="output format: legacy per-rank files (torch) or megatron-core's torch_dist")  # fmt: skip


def _add_module_names(p: argparse.ArgumentParser) -> None:
    p.add_argument("--module-names", choices=("mcore", "legacy"), default=None,
                   help="tensor names in the files: megatron-core's (default for GPT; current Megatron-LM) or the "
                        "legacy nested ones (older Megatron-LM, HF's Megatron GPT-2 converter; always for BERT)")  # fmt: skip


def _add_verify(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verify", action="store_true",
                   help="run source and target on a probe batch; exit 1 if the max difference exceeds --verify-tol")  # fmt: skip
    p.add_argument("--verify-tol", type=float, default=1e-4, help="tolerance of --verify (default 1e-4)")


def _add_hf_verify(p: argparse.ArgumentParser) -> None:
    """to-hf verifies by default (tools.hf_verify): a mismatch exits 2 and leaves no output."""
    p.add_argument("--verify", nargs="?", const="auto", default="auto", choices=("auto", "full", "per-layer"),
                   help="compare the export, loaded by transformers, with the checkpoint on a probe batch "
                        "(default; auto = per-layer when two float32 copies would not fit in half the free memory)")  # fmt: skip
    p.add_argument("--no-verify", dest="verify", action="store_const", const=None,
                   help="write the export without loading it back")  # fmt: skip
    p.add_argument("--verify-tol", type=float, default=1e-4,
                   help="largest difference, relative to max(1, largest |logit|) (default 1e-4)")  # fmt: skip


@cli_entry
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "inspect":
        _check_tokenizer_flags(args)
        return run_inspect(source_from_args(args), as_json=args.json)
    import_torch_frozen()  # (not for --help)
    from pretrain.utils.buffer_pool import pooled_buffers

    split = WorkSplit.from_env()  # under torchrun: this process's share of the output files
    try:
        # tensors built for writing (joined shards, fused QKV, row-parallel shard copies) reuse
        # the buffers of those already written: fresh pages cost the kernel's zeroing
        with split.guard(), pooled_buffers():
            return _checked_convert(args, split)
    finally:
        split.close()


def _checked_convert(args: argparse.Namespace, split: WorkSplit) -> int:
    """The conversion, then (reshard, from-hf) ``--verify`` on rank 0: a failed check removes it."""
    _check_outputs_and_flags(args)
    if not args.verify or args.command == "to-hf":  # to-hf verifies inside its atomic write
        return _convert(args, split)
    announced = io.StringIO()  # "wrote ..." is printed only once the conversion is verified
    with contextlib.redirect_stdout(announced):
        rc = _convert(args, split)
    if rc != 0:
        print(announced.getvalue(), end="")
        return rc
    rc = _verify(args) if split.leader else 0
    rc = max(split.gather(rc))  # the other ranks wait for rank 0's verdict
    if rc != 0:  # a conversion that fails its check is not kept
        if split.leader:
            shutil.rmtree(args.save, ignore_errors=True)
            print(f"error: --verify failed; removed {args.save}", file=sys.stderr)
        return rc
    print(announced.getvalue(), end="")
    return 0


def _check_outputs_and_flags(args: argparse.Namespace) -> None:
    """Before any work: --save writable, --verify-tol sane, --tokenizer-dir a directory."""
    if getattr(args, "dist_optimizer", False) and not (
        args.with_optimizer and args.ckpt_format == "torch_dist"
    ):
        raise UserError("--dist-optimizer needs --with-optimizer and --ckpt-format torch_dist")
    if not args.verify_tol >= 0:  # (also NaN)
        raise UserError(f"--verify-tol must be >= 0, got {args.verify_tol}")
    adapter = getattr(args, "adapter", None)
    if adapter is not None and not Path(adapter).is_dir():
        raise UserError(f"--adapter {adapter}: not a directory")
    if adapter is not None and args.verify:
        raise UserError(
            "--verify compares the new checkpoint with --load, so it does not apply with --adapter"
        )
    _check_tokenizer_flags(args)
    check_writable_output(args.save, kind="dir", flag="--save")


def _check_tokenizer_flags(args: argparse.Namespace) -> None:
    """The tokenizer flags name files and directories that exist."""
    tok = getattr(args, "tokenizer_dir", None)
    if tok is not None and not Path(tok).is_dir():
        raise UserError(f"--tokenizer-dir {tok}: not a directory")
    for name in ("vocab_file", "merge_file", "tokenizer_model"):
        value = getattr(args, name, None)
        if value is not None and not Path(value).exists():
            raise UserError(f"--{name.replace('_', '-')} {value}: no such file")


def _convert(args: argparse.Namespace, split: WorkSplit) -> int:
    if args.command == "reshard":
        with renamed_flag_errors(ParallelConfig, TARGET_FLAGS):  # the user typed --target-tp, not --tp
            target = flags_from_namespace(ParallelConfig, args, dests=TARGET_DESTS)
            rc = run_reshard(source_from_args(args), args.save, target, with_optimizer=args.with_optimizer,
                             ckpt_format=args.ckpt_format, module_names=args.module_names,
                             dist_optimizer=args.dist_optimizer, split=split)  # fmt: skip
    elif args.command == "to-hf":
        rc = run_to_hf(source_from_args(args), args.save, weights_only=args.weights_only,
                       max_shard_size=args.max_shard_size, verify=args.verify, verify_tol=args.verify_tol,
                       lora_as=args.lora_as, split=split)  # fmt: skip
    else:
        target = flags_from_namespace(ParallelConfig, args)
        rc = run_from_hf(args.load, args.save, target, divisible_by=args.make_vocab_size_divisible_by,
                         tokenizer_dir=args.tokenizer_dir, weights_only=args.weights_only,
                         ckpt_format=args.ckpt_format, module_names=args.module_names,
                         force_tokenizer=args.force_tokenizer, adapter=args.adapter,
                         adapter_as=args.adapter_as, split=split)  # fmt: skip
    return rc


def _verify(args: argparse.Namespace) -> int:
    from pretrain.checkpoint.verify import verify_against_hf, verify_checkpoints

    try:
        if args.command == "reshard":
            verify_checkpoints(args.load, args.save, tolerance=args.verify_tol)
            if args.with_optimizer:
                from pretrain.checkpoint.verify import verify_optimizer

                verify_optimizer(args.load, args.save)
        else:
            verify_against_hf(args.save, args.load, tolerance=args.verify_tol)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
