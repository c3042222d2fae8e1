"""``mlm-pretrain gpt|bert``: Megatron-style flags parsed into config dataclasses at the edge.

Single process::

    mlm-pretrain gpt --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 \\
        --micro-batch-size 4 --global-batch-size 8 --train-iters 100 --lr 1e-3 \\
        --data-path data/corpus_text_document --tokenizer-type GPT2BPETokenizer \\
        --vocab-file tok/vocab.json --merge-file tok/merges.txt --save ckpt

Parallel (tp=2, pp=2, gloo on CPU / NCCL on GPUs, chosen automatically)::

    torchrun --nproc-per-node 4 -m pretrain.training.cli gpt --tensor-model-parallel-size 2 \\
        --pipeline-model-parallel-size 2 ...

Every flag is validated before any process group starts; bad input gives one line and exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from pretrain.checkpoint.args import training_metadata
from pretrain.config import DTypeFlags, DTypeName, ModelConfig
from pretrain.data.gpt_dataset import GPTDatasetConfig, data_hash
from pretrain.model_option_flags import add_model_flags, config_kwargs_from_flags
from pretrain.models import cpu_gemm, fused_kernels
from pretrain.models.kinds import KINDS, kind_of
from pretrain.models.moe.dispatch import check_expert_parallel
from pretrain.optim.config import LRScheduleConfig, OptimizerConfig
from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.layout import check_expert_sizes, check_sizes
from pretrain.pipeline.partition import stage_layer_numbers
from pretrain.tokenizer.factory import TokenizerConfig, build_tokenizer
from pretrain.tokenizer.flags import add_tokenizer_arguments
from pretrain.training.config import TrainingConfig
from pretrain.training.run_configs import PretrainConfigs
from pretrain.training.task import TrainTask
from pretrain.utils.cli import OneLineParser
from pretrain.utils.errors import UserError, cli_entry
from pretrain.utils.flag_groups import add_flag_group, flags_from_namespace
from pretrain.utils.outputs import check_writable_output


def add_model_args(p: OneLineParser) -> None:
    g = p.add_argument_group("model")
    add_model_flags(g)  # every model option's flag, from the one table (Megatron's names)
    g.add_argument("--apply-residual-connection-post-layernorm", "--post-layernorm", dest="post_layernorm",
                   action="store_true", help="BERT: original post-LN arrangement (paper figure 7a)")  # fmt: skip


def add_parallel_args(p: OneLineParser) -> None:
    g = p.add_argument_group("parallelism")
    add_flag_group(p, ParallelConfig, title="parallelism", group=g, include=("tp", "pp"))
    g.add_argument(
        "--num-layers-per-virtual-pipeline-stage", type=int, default=None
    )  # sets ParallelConfig.vp
    add_flag_group(p, ParallelConfig, title="parallelism", group=g,
                   include=("num_layers_in_first_stage", "num_layers_in_last_stage", *ParallelConfig.EXPERT))  # fmt: skip
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--pipeline-schedule", choices=("1f1b", "fthenb"), default="1f1b")


def add_training_args(p: OneLineParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--seq-length", type=int, required=True)
    g.add_argument("--micro-batch-size", type=int, required=True)
    g.add_argument("--global-batch-size", type=int, required=True)
    g.add_argument("--train-iters", type=int, required=True)
    g.add_argument("--lr", type=float, default=1.5e-4)
    g.add_argument("--min-lr", type=float, default=1.0e-5)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--lr-decay-style", choices=("cosine", "linear", "constant"), default="cosine")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0)
    add_flag_group(p, DTypeFlags, title="training", group=g, include=("bf16", "fp16"))
    g.add_argument("--loss-scale", type=float, default=None)
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--log-json", default=None, help="append one JSON object per iteration to this file")
    g.add_argument("--eval-interval", type=int, default=0)
    g.add_argument("--eval-iters", type=int, default=10)
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=0)
    g.add_argument("--finetune", action="store_true", help="load weights only and start at iteration 0")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument(
        "--no-progress", action="store_true", help="no progress bar (plain log lines off a terminal)"
    )
    add_run_control_args(p)


def add_run_control_args(p: OneLineParser) -> None:
    """Megatron's resume, warmup and early-exit flags, and --overwrite."""
    g = p.add_argument_group("resume and exit")
    g.add_argument("--overwrite", action="store_true",
                   help="train into a --save that already holds a checkpoint without --load (start over)")  # fmt: skip
    g.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler", action="store_true",
                   dest="override_opt_param_scheduler",
                   help="on --load, use this run's LR flags instead of the checkpoint's schedule")  # fmt: skip
    g.add_argument("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler",
                   action="store_true", dest="use_checkpoint_opt_param_scheduler",
                   help="on --load, keep the checkpoint's LR schedule (lr, min lr, warmup, decay)")  # fmt: skip
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="warmup as a fraction of --lr-decay-iters (instead of --lr-warmup-iters)")  # fmt: skip
    g.add_argument("--exit-interval", type=int, default=0, help="save and exit when iteration %% N == 0")
    g.add_argument("--exit-duration-in-mins", type=float, default=0.0, help="save and exit after N minutes")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM, finish the iteration, save a checkpoint and exit cleanly")  # fmt: skip


def add_data_args(p: OneLineParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="+", required=True, help="prefix, or 'weight prefix' pairs to blend")
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--eod-mask-loss", action="store_true")
    add_tokenizer_arguments(p)  # type: ignore[arg-type]


def build_parser() -> OneLineParser:
    parser = OneLineParser(prog="mlm-pretrain", description="Megatron-style parallel pretraining.")
    sub = parser.add_subparsers(dest="model", required=True, parser_class=OneLineParser)
    for kind in KINDS.values():
        p = sub.add_parser(kind.name, help=kind.help)
        for add in (add_model_args, add_parallel_args, add_training_args, add_data_args):
            add(p)
    return parser


def parallel_from_args(args: argparse.Namespace, *, num_layers: int) -> ParallelConfig:
    """The layout of :func:`add_parallel_args`' flags; ``vp`` from Megatron's
    ``--num-layers-per-virtual-pipeline-stage`` (checked against ``num_layers`` first)."""
    from pretrain.utils.config_flags import virtual_pipeline_size

    vp = virtual_pipeline_size(num_layers, args.pp, args.num_layers_per_virtual_pipeline_stage)
    return dataclasses.replace(flags_from_namespace(ParallelConfig, args), vp=vp)


def _check_layout(model: ModelConfig, parallel: ParallelConfig, *, seq_length: int, world_size: int) -> int:
    """Refuse a model / layout / sequence combination that cannot train; the data-parallel size."""
    model.check_training_tensor_parallel(parallel.tp)
    if model.fused_kernels:
        fused_kernels.check_compiler()
    cpu_gemm.check_available(model.cpu_gemm)
    check_expert_parallel(model, parallel.ep, etp=parallel.expert_tp, tp=parallel.tp)
    if model.sequence_parallel and seq_length % parallel.tp:
        raise UserError(
            f"--sequence-parallel: --seq-length {seq_length} is not divisible by --tensor-model-parallel-size "
            f"{parallel.tp}"
        )
    if seq_length > model.max_position_embeddings:
        raise UserError(
            f"--seq-length {seq_length} exceeds --max-position-embeddings {model.max_position_embeddings}"
        )
    if world_size % (parallel.tp * parallel.pp):
        raise UserError(
            f"{world_size} process(es) (WORLD_SIZE, from torchrun) cannot be split into --tensor-model-parallel-size "
            f"{parallel.tp} x --pipeline-model-parallel-size {parallel.pp} = {parallel.tp * parallel.pp}; "
            f"launch a multiple of {parallel.tp * parallel.pp} processes"
        )
    dp = check_sizes(world_size, parallel.tp, parallel.pp, parallel.vp)
    check_expert_sizes(world_size, parallel.tp, parallel.pp, parallel.ep, parallel.expert_tp)
    stage_layer_numbers(model.num_layers, pp=parallel.pp, vp=parallel.vp,
                        first=parallel.num_layers_in_first_stage, last=parallel.num_layers_in_last_stage)  # fmt: skip
    return dp


def configs_from_args(args: argparse.Namespace, *, world_size: int) -> PretrainConfigs:
    """Every config of a run, validated (no process group needed)."""
    tok_cfg = TokenizerConfig.from_args(args)
    tokenizer = build_tokenizer(tok_cfg)
    parallel = parallel_from_args(args, num_layers=args.num_layers)
    dtype: DTypeName = flags_from_namespace(DTypeFlags, args).dtype_name()
    kind = kind_of(args.model, where="mlm-pretrain")
    options = {
        **config_kwargs_from_flags(args),
        "max_position_embeddings": args.max_position_embeddings or args.seq_length,
    }
    model = ModelConfig(vocab_size=tokenizer.vocab_size, params_dtype=dtype, bidirectional=kind.bidirectional,
                        num_tokentypes=kind.tokentypes, post_layernorm=args.post_layernorm, **options)  # type: ignore[arg-type]  # fmt: skip
    dp = _check_layout(model, parallel, seq_length=args.seq_length, world_size=world_size)
    for flag, path in (("--save", args.save), ("--load", args.load)):
        if path and model.num_experts and parallel.tp % parallel.expert_tp:
            # rank files are named by TP, PP and EP rank only (Megatron's get_checkpoint_name)
            raise UserError(
                f"{flag} {path}: --expert-tensor-parallel-size {parallel.expert_tp} does not divide "
                f"--tensor-model-parallel-size {parallel.tp}: checkpoint rank files (mp_rank_TT[_PPP][_EEE]) "
                "cannot hold such expert shards; use an ETP dividing TP"
            )
    train = TrainingConfig(
        micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
        train_iters=args.train_iters, seq_length=args.seq_length, seed=args.seed, log_interval=args.log_interval,
        eval_interval=args.eval_interval, eval_iters=args.eval_iters, save=args.save, load=args.load,
        save_interval=args.save_interval, finetune=args.finetune, no_load_optim=args.no_load_optim,
        no_load_rng=args.no_load_rng, log_json=args.log_json, schedule=args.pipeline_schedule,
        overlap_grad_reduce=args.overlap_grad_reduce, progress=not args.no_progress,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        exit_interval=args.exit_interval, exit_duration_in_mins=args.exit_duration_in_mins,
        exit_signal_handler=args.exit_signal_handler,
    )  # fmt: skip
    train.num_microbatches(dp)
    optim = OptimizerConfig(
        lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, clip_grad=args.clip_grad,
        use_distributed_optimizer=args.use_distributed_optimizer, fp16=args.fp16, bf16=args.bf16,
        loss_scale=args.loss_scale, initial_loss_scale=args.initial_loss_scale,
    )  # fmt: skip
    lr = lr_schedule_from_args(args)
    for path in args.data_path:
        if not os.path.exists(path + ".idx") and not _is_number(path):
            raise UserError(f"--data-path {path}: no indexed dataset {path}.idx (run mlm-preprocess first)")
    check_data_fits(args, tokenizer.vocab_size)
    check_outputs(args)
    data = GPTDatasetConfig(seq_length=args.seq_length, data_prefix=tuple(args.data_path), seed=args.seed,
                            split=args.split, cache_dir=args.data_cache_path, eod_mask_loss=args.eod_mask_loss,
                            eod_id=tokenizer.eod)  # fmt: skip
    return PretrainConfigs(kind=kind.name, tokenizer_cfg=tok_cfg, tokenizer=tokenizer, parallel=parallel, model=model,
                           train=train, optim=optim, lr=lr, data=data)  # fmt: skip


def lr_schedule_from_args(args: argparse.Namespace) -> LRScheduleConfig:
    """The LR schedule, with every inconsistency named by its flags."""
    if args.train_iters < 1:
        raise UserError(f"--train-iters must be >= 1, got {args.train_iters}")
    decay = args.lr_decay_iters if args.lr_decay_iters is not None else args.train_iters
    warmup = args.lr_warmup_iters
    if args.lr_warmup_fraction is not None:
        if warmup:
            raise UserError("--lr-warmup-fraction and --lr-warmup-iters exclude each other")
        if not 0.0 <= args.lr_warmup_fraction < 1.0:
            raise UserError(f"--lr-warmup-fraction must be in [0, 1), got {args.lr_warmup_fraction}")
        warmup = int(args.lr_warmup_fraction * decay)
    if warmup < 0:
        raise UserError(f"--lr-warmup-iters must be >= 0, got {warmup}")
    if args.lr_decay_style != "constant" and decay <= warmup:
        src = (
            f"--lr-warmup-fraction {args.lr_warmup_fraction}"
            if args.lr_warmup_fraction
            else "--lr-warmup-iters"
        )
        raise UserError(
            f"--lr-decay-iters {decay} (default: --train-iters) must exceed the warmup ({src}: {warmup} iterations)"
        )
    return LRScheduleConfig(lr=args.lr, min_lr=min(args.min_lr, args.lr), decay_style=args.lr_decay_style,
                            warmup_iters=warmup,
                            decay_iters=decay if args.lr_decay_style != "constant" else None)  # fmt: skip


def check_data_fits(args: argparse.Namespace, vocab_size: int) -> None:
    """Before any work: every dataset holds a sample of --seq-length and only ids the tokenizer knows."""
    from pretrain.data.indexed_dataset import IndexedDataset

    for prefix in args.data_path:
        if _is_number(prefix):
            continue
        ds = IndexedDataset(prefix)
        if ds.num_tokens <= args.seq_length:
            raise UserError(
                f"--seq-length {args.seq_length} exceeds the data: --data-path {prefix} holds {ds.num_tokens} "
                f"tokens in all (a sample needs {args.seq_length + 1})"
            )
        top = ds.max_token_id()
        if top >= vocab_size:
            raise UserError(
                f"--data-path {prefix}: token id {top} is beyond the tokenizer's vocabulary of {vocab_size} "
                f"({args.tokenizer_type}); preprocess the data with the same tokenizer"
            )


def check_outputs(args: argparse.Namespace) -> None:
    """Before any work: --save is writable and not a finished run unless resumed or --overwrite."""
    from pretrain.checkpoint.legacy.layout import TRACKER

    if args.log_json:
        check_writable_output(args.log_json, kind="file", flag="--log-json")
    if not args.save:
        return
    check_writable_output(args.save, kind="dir", flag="--save")
    tracker = Path(args.save) / TRACKER
    if tracker.exists() and not args.load and not args.overwrite:
        latest = tracker.read_text(encoding="utf-8", errors="replace").strip()
        raise UserError(
            f"--save {args.save} already holds a checkpoint (iteration {latest}); resume it with --load "
            f"{args.save}, choose another --save, or pass --overwrite to start over"
        )


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def build_task(cfgs: PretrainConfigs) -> TrainTask:
    """The task of the run's model kind: next-token prediction (causal), else MLM + SOP."""
    if kind_of(cfgs.kind, where="mlm-pretrain").causal_lm:
        from pretrain.training.gpt_task import GPTTask

        return GPTTask(model_cfg=cfgs.model, data_cfg=cfgs.data, train_cfg=cfgs.train)
    from pretrain.training.bert_task import BertTask

    return BertTask.from_configs(cfgs)


@cli_entry
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfgs = configs_from_args(args, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    task = build_task(cfgs)
    from pretrain.training.loop import setup_parallel, train

    ps = setup_parallel(cfgs.parallel, seed=cfgs.train.seed)
    ckpt = training_metadata(cfgs.model, cfgs.parallel, kind=cfgs.kind, tokenizer=cfgs.tokenizer,
                             save=cfgs.train.save, write_tokenizer=ps.rank == 0, argv=list(argv or sys.argv[1:]),
                             global_batch_size=cfgs.train.global_batch_size,
                             data_hash=data_hash(cfgs.data.blend))  # fmt: skip
    result = train(task, ps=ps, optim_cfg=cfgs.optim, lr_cfg=cfgs.lr, cfg=cfgs.train, ckpt_args=ckpt)
    if ps.rank == 0 and result["history"]:
        first, last = result["history"][0], result["history"][-1]
        print(json.dumps({"first_loss": first["loss"], "final_loss": last["loss"],
                          "iterations": last["iteration"], "save": cfgs.train.save}))  # fmt: skip
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
