"""``mlm-finetune sft``: supervised fine-tuning of a decoder on chat or prompt/completion JSONL.

Examples::

    mlm-finetune sft --hf-model ./tiny-llama --data builtin:sft_chat --epochs 2 --lr 1e-4 --save sft
    torchrun --nproc-per-node 4 -m finetune.cli sft --ckpt ck --data train.jsonl --valid-data valid.jsonl \\
        --tp 2 --pp 2 --pack --results-dir out/sft
    mlm-finetune sft --eval-only --ckpt sft --data valid.jsonl --results-dir out/sft_eval

Full-parameter SFT on the one training loop (any TP x PP x DP, ZeRO-1 with
``--use-distributed-optimizer``). ``results.json`` (kind ``finetune``, task ``sft``) holds
``valid_loss`` (token-weighted mean NLL over every loss token of the validation file; with
``--eval-only`` of ``--valid-data``, else ``--data``), the loss-token count, truncated and skipped
samples, the chat template's sha256, the LoRA settings (null: full SFT), layout and dtype.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from finetune.sft.data import BUILTIN_DATA, encode_data, read_data
from finetune.sft.samples import LOSS_ON
from finetune.sft.source import Decoder, load_decoder
from pretrain.config import DTypeFlags, ModelConfig
from pretrain.model_option_flags import add_model_override_flags, model_overrides_from_flags
from pretrain.models import cpu_gemm, fused_kernels
from pretrain.models.lora import LoraConfig, LoraFlags
from pretrain.parallel.config import ParallelConfig
from pretrain.tokenizer.flags import TokenizerFlags
from pretrain.training.cli import add_parallel_args, parallel_from_args
from pretrain.utils.cli import OneLineParser
from pretrain.utils.errors import UserError, cli_entry
from pretrain.utils.flag_groups import add_flag_group, flags_from_namespace
from pretrain.utils.outputs import check_writable_output

# model options a run may change, with the option table's flags (left out: the model's value)
MODEL_OVERRIDES = ("hidden_dropout", "attention_dropout", "fused_kernels", "cpu_gemm")


def build_parser() -> OneLineParser:
    p = OneLineParser(prog="mlm-finetune sft", description="Supervised fine-tuning of a decoder (chat or "
                      "prompt/completion JSON lines).")  # fmt: skip
    g = p.add_argument_group("model and data")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--ckpt", help="our or Megatron GPT/Llama checkpoint directory (any layout)")
    src.add_argument("--hf-model", help="local Hugging Face decoder directory (weights + tokenizer)")
    g.add_argument("--data", required=True, help="training JSONL ({messages} or {prompt, completion}), or "
                   f"{' / '.join(BUILTIN_DATA)}")  # fmt: skip
    g.add_argument("--valid-data", default=None, help="validation JSONL (valid_loss)")
    g.add_argument(
        "--chat-template", default=None, metavar="FILE", help="Jinja chat template (default: the tokenizer's)"
    )
    g.add_argument("--loss-on", choices=LOSS_ON, default=None,
                   help="default: assistant for chat data, completion for prompt/completion data")  # fmt: skip
    g.add_argument(
        "--pack", action="store_true", help="several samples per sequence (attention kept within each)"
    )
    g.add_argument("--eval-only", action="store_true", help="only valid_loss of the model, no training")
    add_flag_group(
        p, TokenizerFlags, title="tokenizer", group=g, include=("tokenizer_dir", "force_tokenizer")
    )
    t = p.add_argument_group("training")
    t.add_argument("--seq-length", type=int, default=None, help="default: min(2048, the model's positions)")
    t.add_argument("--epochs", type=float, default=1.0)
    t.add_argument("--global-batch-size", type=int, default=8)
    t.add_argument(
        "--micro-batch-size", type=int, default=None, help="default: global batch / DP size, max 8"
    )
    t.add_argument("--lr", type=float, default=1e-5)
    t.add_argument("--min-lr", type=float, default=0.0)
    t.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine"), default="linear")
    t.add_argument("--lr-warmup-fraction", type=float, default=0.0)
    t.add_argument("--weight-decay", type=float, default=0.0)
    t.add_argument("--clip-grad", type=float, default=1.0)
    t.add_argument("--seed", type=int, default=1234)
    add_model_override_flags(t, MODEL_OVERRIDES)
    add_flag_group(p, DTypeFlags, title="training", group=t, include=("bf16", "fp16"))
    add_flag_group(p, LoraFlags, title="LoRA (default: full-parameter SFT)")
    o = p.add_argument_group("output")
    o.add_argument("--save", default=None, help="save the fine-tuned model here (our checkpoint format)")
    o.add_argument("--overwrite", action="store_true", help="replace a checkpoint already in --save")
    o.add_argument("--results-dir", default=None, help="results.json")
    o.add_argument("--log-interval", type=int, default=10)
    o.add_argument("--log-json", default=None)
    o.add_argument("--no-progress", action="store_true")
    add_parallel_args(p)
    return p


def lora_from_flags(args: argparse.Namespace) -> LoraConfig | None:
    """The ``--lora-*`` flags as a :class:`LoraConfig` (None without ``--lora-rank``)."""
    lora = flags_from_namespace(LoraFlags, args).config()
    if lora is not None and args.fp16:
        raise UserError(
            "--fp16 with --lora-rank: LoRA adapters train in float32 beside the frozen base; use --bf16"
        )
    return lora


def _check_flags(args: argparse.Namespace) -> None:
    """Refusals that need no file read: ranges, --eval-only with --save, outputs (LoRA: lora_from_flags)."""
    from pretrain.checkpoint.legacy.layout import TRACKER

    for flag, ok, rule in (("--epochs", args.epochs > 0, "> 0"), ("--lr", args.lr >= 0, ">= 0"),
                           ("--lr-warmup-fraction", 0 <= args.lr_warmup_fraction < 1, "in [0, 1)"),
                           ("--global-batch-size", args.global_batch_size >= 1, ">= 1"),
                           ("--seq-length", args.seq_length is None or args.seq_length >= 2, ">= 2")):  # fmt: skip
        if not ok:
            raise UserError(f"{flag} must be {rule}, got {getattr(args, flag[2:].replace('-', '_'))}")
    flags_from_namespace(DTypeFlags, args).dtype_name()  # --bf16 with --fp16: refused
    if args.fused_kernels:
        fused_kernels.check_compiler()
    if args.cpu_gemm is not None:
        cpu_gemm.check_available(args.cpu_gemm)
    if args.eval_only and args.save is not None:
        raise UserError("--eval-only trains nothing to --save; drop --save")
    if args.chat_template is not None and not Path(args.chat_template).is_file():
        raise UserError(f"--chat-template: file not found: {args.chat_template}")
    if args.results_dir is not None:
        check_writable_output(args.results_dir, kind="dir", flag="--results-dir", shared=True)
    if args.log_json is not None:
        check_writable_output(args.log_json, kind="file", flag="--log-json")
    if args.save is not None:
        check_writable_output(args.save, kind="dir", flag="--save")
        if (Path(args.save) / TRACKER).exists() and not args.overwrite:
            raise UserError(f"--save {args.save} already holds a checkpoint; choose another --save or pass "
                            "--overwrite to replace it")  # fmt: skip


def _model_cfg(args: argparse.Namespace, dec: Decoder) -> tuple[ModelConfig, int]:
    changes: dict[str, Any] = {"params_dtype": flags_from_namespace(DTypeFlags, args).dtype_name(),
                               **model_overrides_from_flags(args, MODEL_OVERRIDES)}  # fmt: skip
    cfg = dataclasses.replace(dec.cfg, **changes)
    seq_length = args.seq_length or min(2048, cfg.max_position_embeddings)
    if seq_length > cfg.max_position_embeddings:
        raise UserError(
            f"--seq-length {seq_length} exceeds the model's {cfg.max_position_embeddings} positions"
        )
    return cfg, seq_length


@cli_entry
def main(argv: list[str] | None = None) -> int:
    from finetune.sft.run import run_sft

    args = build_parser().parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    _check_flags(args)
    lora = lora_from_flags(args)
    records, loss_on = read_data(args)
    dec = load_decoder(ckpt=args.ckpt, hf_model=args.hf_model, tokenizer_dir=args.tokenizer_dir,
                       force_tokenizer=args.force_tokenizer)  # fmt: skip
    if dec.lora is not None:
        if lora is not None:
            raise UserError(
                f"--ckpt {args.ckpt} holds a LoRA adapter (rank {dec.lora.rank}); drop the --lora-* flags"
            )
        lora = dec.lora
    cfg, seq_length = _model_cfg(args, dec)
    parallel = parallel_from_args(args, num_layers=cfg.num_layers)
    cfg.check_tensor_parallel(parallel.tp)
    dp = _data_parallel_size(parallel)
    data = encode_data(args, records, loss_on, dec, seq_length)
    return run_sft(args, dec, cfg, parallel, data, seq_length=seq_length, dp=dp, lora=lora)


def _data_parallel_size(parallel: ParallelConfig) -> int:
    """The DP size of this launch (WORLD_SIZE / (tp x pp)); refused when it does not divide."""
    import os

    from pretrain.parallel.layout import check_sizes

    return check_sizes(int(os.environ.get("WORLD_SIZE", "1")), parallel.tp, parallel.pp, parallel.vp)


if __name__ == "__main__":
    sys.exit(main())
