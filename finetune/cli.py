"""``mlm-finetune TASK``: finetune a BERT on GLUE, SQuAD 1.1/2.0 or RACE with the paper's presets.

``mlm-finetune sft ...`` (supervised fine-tuning of decoders) is :mod:`finetune.sft.cli`.

Examples::

    mlm-finetune mnli --ckpt ckpts/bert336m --data-dir glue_data --preset 336m --results-dir out/mnli
    mlm-finetune squad --hf-model ./bert-base-uncased --data-dir squad --epochs 2 --seeds 5
    torchrun --nproc-per-node 8 -m finetune.cli race --ckpt ckpts/bert3.8b --data-dir RACE \\
        --preset 3.8b --tp 4 --pp 2 --bf16 --save ft/race
    mlm-finetune race --eval-only --ckpt ft/race --data-dir RACE --results-dir out/race

Table 6 presets (:mod:`finetune.presets`) give batch size, learning rate, epochs and sequence
length; Megatron-named flags override them. ``--seeds N`` finetunes N times (seeds ``--seed``,
``--seed``+1, ...) and reports the median of each metric, as the paper does. Results go to
``--results-dir/results.json`` (schema ``mlm-toolkit/result/v1``, kind ``finetune``) with the
prediction files beside it. ``--eval-only --ckpt DIR`` evaluates a checkpoint written by
``--save`` (same TP/PP layout). Bad input gives one line and exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.builtin import resolve_data_dir
from finetune.hyper import Hyperparameters, hyperparameters_from_args
from finetune.init_from import Pretrained, load_pretrained, tokenizer_from_dir
from finetune.presets import SIZES, TASK_NAMES
from finetune.task_data import check_task_files, load_task_data
from finetune.tasks import FinetuneTask, TaskData, predict_all, train_iterations
from finetune.tokenization import PairEncoder
from pretrain.checkpoint.args import training_metadata
from pretrain.checkpoint.metadata import require_metadata
from pretrain.checkpoint.types import CheckpointMetadata, FinetuneRecord
from pretrain.config import DTypeFlags, DTypeName, ModelConfig
from pretrain.model_option_flags import add_model_override_flags, model_overrides_from_flags
from pretrain.optim.config import LRScheduleConfig, OptimizerConfig
from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.layout import check_sizes
from pretrain.parallel.state import ParallelState
from pretrain.tokenizer.flags import TokenizerFlags
from pretrain.training.cli import add_parallel_args, parallel_from_args
from pretrain.training.config import TrainingConfig
from pretrain.utils.cli import OneLineParser
from pretrain.utils.errors import UserError, cli_entry
from pretrain.utils.flag_groups import add_flag_group, flags_from_namespace
from pretrain.utils.outputs import check_writable_output
from pretrain.utils.results import TASK_METRICS, make_result, write_result

# model options a run may change: the option table's flags, with Megatron's finetune defaults
MODEL_OVERRIDES = ("hidden_dropout", "attention_dropout")
RESULT_TASK = {"squad": "squad1"}  # CLI name -> results schema task name


def build_parser() -> OneLineParser:
    p = OneLineParser(
        prog="mlm-finetune",
        description="Finetune BERT on GLUE, SQuAD 1.1/2.0 or RACE (decoders: mlm-finetune sft --help).",
    )
    p.add_argument("task", choices=TASK_NAMES)
    g = p.add_argument_group("model and data")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--ckpt", help="our (any layout) or upstream Megatron BERT checkpoint directory")
    src.add_argument("--hf-model", help="local Hugging Face BERT directory (weights + tokenizer)")
    g.add_argument("--data-dir", required=True,
                   help="official task files (GLUE TSV, SQuAD JSON, RACE dirs), or builtin:NAME (e.g. builtin:sst2_tiny)")  # fmt: skip
    tok = g.add_mutually_exclusive_group()
    add_flag_group(p, TokenizerFlags, title="tokenizer", group=tok, include=("tokenizer_dir", "vocab_file"))
    g.add_argument("--cased", action="store_true", help="--vocab-file is cased (default: lower case)")
    add_flag_group(p, TokenizerFlags, title="tokenizer", group=g, include=("force_tokenizer",))
    g.add_argument("--eval-only", action="store_true", help="evaluate the finetuned --ckpt, no training")
    t = p.add_argument_group("finetuning (default: the --preset)")
    t.add_argument("--preset", choices=SIZES, default="336m")
    t.add_argument("--epochs", type=float, default=None)
    t.add_argument("--global-batch-size", type=int, default=None)
    t.add_argument(
        "--micro-batch-size", type=int, default=None, help="default: global batch / DP size, max 8"
    )
    t.add_argument("--lr", type=float, default=None)
    t.add_argument("--lr-warmup-fraction", type=float, default=None)
    t.add_argument("--weight-decay", type=float, default=None)
    t.add_argument("--clip-grad", type=float, default=1.0)
    t.add_argument("--seq-length", type=int, default=None)
    t.add_argument("--doc-stride", type=int, default=128, help="SQuAD window stride")
    t.add_argument("--max-query-length", type=int, default=64, help="SQuAD question tokens")
    t.add_argument("--null-score-diff-threshold", type=float, default=0.0, help="SQuAD 2.0")
    add_model_override_flags(t, MODEL_OVERRIDES, defaults={"hidden_dropout": 0.1, "attention_dropout": 0.1})
    add_flag_group(p, DTypeFlags, title="finetuning", group=t, include=("bf16", "fp16"))
    t.add_argument("--seed", type=int, default=1234)
    t.add_argument("--seeds", type=int, default=1, help="finetune N times, report the median")
    o = p.add_argument_group("output")
    o.add_argument("--save", default=None, help="save the finetuned model here (seed_K/ for --seeds > 1)")
    o.add_argument("--results-dir", default=None, help="results.json and prediction files")
    o.add_argument("--log-interval", type=int, default=10)
    o.add_argument("--log-json", default=None)
    o.add_argument("--eval-interval", type=int, default=0, help="validation loss every N iterations")
    o.add_argument("--eval-iters", type=int, default=10)
    o.add_argument("--no-progress", action="store_true")
    o.add_argument("--overwrite", action="store_true", help="replace a checkpoint already in --save")
    add_parallel_args(p)
    return p


@dataclass(frozen=True, kw_only=True)
class SeedRunContext:
    """What every seed's run shares: hyperparameters, task data, layout, model and its source."""

    hyper: Hyperparameters
    data: TaskData
    ps: ParallelState
    micro_batch_size: int
    model_cfg: ModelConfig
    pretrained: Pretrained
    ckpt_args: CheckpointMetadata


HYPER_FLAGS = ("epochs", "global_batch_size", "lr", "seq_length", "lr_warmup_fraction", "weight_decay", "preset",
               "micro_batch_size", "clip_grad", "doc_stride", "max_query_length")  # fmt: skip


def _with_saved_hyperparameters(args: Any, saved_argv: tuple[str, ...]) -> Any:
    """--eval-only: the finetuning run's own flags (from the checkpoint) for every flag not given now."""
    if not saved_argv:
        return args
    try:
        saved = build_parser().parse_args(list(saved_argv))
    except SystemExit:  # a checkpoint of another version: keep today's defaults
        return args
    given = {a.lstrip("-").split("=")[0].replace("-", "_") for a in (args.argv or []) if a.startswith("--")}
    merged = dict(vars(args))
    for name in HYPER_FLAGS:
        if name not in given and hasattr(saved, name):
            merged[name] = getattr(saved, name)
    return type(args)(**merged)


def _check_outputs(args: Any) -> None:
    """Before any work: the output locations are writable; --save holds no checkpoint unless --overwrite."""
    from pretrain.checkpoint.legacy.layout import TRACKER

    if args.results_dir is not None:
        check_writable_output(args.results_dir, kind="dir", flag="--results-dir", shared=True)
    if args.log_json is not None:
        check_writable_output(args.log_json, kind="file", flag="--log-json")
    if args.save is None:
        return
    check_writable_output(args.save, kind="dir", flag="--save")
    save = Path(args.save)
    trackers = [save / TRACKER, *save.glob(f"seed_*/{TRACKER}")]
    if any(t.exists() for t in trackers) and not args.overwrite:
        raise UserError(f"--save {args.save} already holds a finetuned checkpoint; choose another --save or "
                        "pass --overwrite to replace it")  # fmt: skip


def _eval_only_source(args: Any) -> Pretrained:
    """Model config and tokenizer of a finetuned checkpoint written by ``--save``."""
    from pretrain.checkpoint.legacy.io import load_rank_file
    from pretrain.checkpoint.legacy.layout import MODEL_FILE, list_rank_dirs, resolve_iteration

    if args.ckpt is None:
        raise UserError("--eval-only needs --ckpt DIR (a checkpoint written by mlm-finetune --save)")
    if args.save is not None:
        raise UserError("--eval-only trains nothing to --save; drop --save")
    it_dir = resolve_iteration(args.ckpt, None)
    ckpt_args = load_rank_file(next(iter(list_rank_dirs(it_dir).values())) / MODEL_FILE).get("args") or {}
    meta = require_metadata(ckpt_args, source=f"--ckpt {args.ckpt}")
    task = meta.finetune.task if meta.finetune is not None else None
    if task != args.task:
        raise UserError(f"--ckpt {args.ckpt}: not a {args.task} finetuning checkpoint (task {task!r})")
    tok_dir = args.tokenizer_dir or Path(args.ckpt) / "tokenizer"
    args.saved_argv = tuple(meta.provenance.argv)
    # results of the re-evaluation belong to the model the run finetuned: its name and fingerprint
    # (a checkpoint from before they were recorded: the finetuned weights' own fingerprint)
    ft = meta.finetune
    fingerprint = ft.source_fingerprint if ft is not None else None
    if fingerprint is None:
        from pretrain.checkpoint.fingerprint import weights_fingerprint
        from pretrain.checkpoint.opener import open_checkpoint

        fingerprint = weights_fingerprint(open_checkpoint(args.ckpt))
    name = Path(ft.source).name if ft is not None and ft.source else Path(args.ckpt).name
    return Pretrained(cfg=meta.model, tensors={}, tokenizer=tokenizer_from_dir(tok_dir), source=args.ckpt,
                      fingerprint=fingerprint, name=name)  # fmt: skip


def _model_cfg(args: Any, pre: Pretrained, seq_length: int) -> ModelConfig:
    dtype: DTypeName = flags_from_namespace(DTypeFlags, args).dtype_name()
    changes: dict[str, Any] = {"params_dtype": dtype, **model_overrides_from_flags(args, MODEL_OVERRIDES)}
    cfg = dataclasses.replace(pre.cfg, **changes)
    if seq_length > cfg.max_position_embeddings:
        raise UserError(
            f"--seq-length {seq_length} exceeds the model's {cfg.max_position_embeddings} positions"
        )
    return cfg


def _parallel(args: Any, cfg: ModelConfig) -> tuple[ParallelConfig, int]:
    parallel = parallel_from_args(args, num_layers=cfg.num_layers)  # the same flags and rules as mlm-pretrain
    cfg.check_tensor_parallel(parallel.tp)
    return parallel, check_sizes(
        int(os.environ.get("WORLD_SIZE", "1")), parallel.tp, parallel.pp, parallel.vp
    )


def _save_tokenizer(tokenizer: Any, path: Path) -> None:
    """The tokenizer's files beside the finetuned checkpoint (what its record names)."""
    from pretrain.tokenizer.loader import save_tokenizer

    save_tokenizer(tokenizer, path)


def _run_seed(args: argparse.Namespace, k: int, ctx: SeedRunContext) -> dict[str, Any]:
    """Finetune (unless ``--eval-only``) and evaluate with seed ``--seed + k``."""
    from pretrain.training.loop import count_parameters, train

    h, data, ps, rank0 = ctx.hyper, ctx.data, ctx.ps, ctx.ps.rank == 0
    seed = args.seed + k
    ps.seed(seed)
    many = args.seeds > 1
    save = None if args.save is None else str(Path(args.save) / f"seed_{k}" if many else Path(args.save))
    iters = (
        0 if args.eval_only else train_iterations(len(data.train["tokens"]), h.epochs, h.global_batch_size)
    )
    train_cfg = TrainingConfig(
        micro_batch_size=ctx.micro_batch_size, global_batch_size=h.global_batch_size, train_iters=iters,
        seq_length=h.seq_length, seed=seed, log_interval=args.log_interval, eval_interval=args.eval_interval,
        eval_iters=args.eval_iters, save=save, load=args.ckpt if args.eval_only else None, finetune=True,
        log_json=args.log_json, schedule=args.pipeline_schedule, overlap_grad_reduce=args.overlap_grad_reduce,
        progress=not args.no_progress and iters > 0,
    )  # fmt: skip
    optim = OptimizerConfig(lr=h.lr, min_lr=0.0, weight_decay=h.weight_decay, clip_grad=args.clip_grad,
                            use_distributed_optimizer=args.use_distributed_optimizer, fp16=args.fp16, bf16=args.bf16)  # fmt: skip
    lr = (LRScheduleConfig(lr=h.lr, min_lr=0.0, decay_style="constant") if iters == 0 else
          LRScheduleConfig(lr=h.lr, min_lr=0.0, decay_style="linear", warmup_iters=int(h.warmup * iters),
                           decay_iters=iters))  # fmt: skip
    task = FinetuneTask(data=data, model_cfg=ctx.model_cfg, train_cfg=train_cfg,
                        pretrained=None if args.eval_only else ctx.pretrained.tensors)  # fmt: skip
    result = train(task, ps=ps, optim_cfg=optim, lr_cfg=lr, cfg=train_cfg, ckpt_args=ctx.ckpt_args)
    if save is not None and rank0:
        _save_tokenizer(ctx.pretrained.tokenizer, Path(save) / "tokenizer")
    outputs = predict_all(result["trainer"].chunks, ps, data, ctx.micro_batch_size)
    out_dir = None
    if args.results_dir is not None and rank0:
        out_dir = str(Path(args.results_dir) / f"seed_{k}" if many else Path(args.results_dir))
    scored = data.score(outputs, out_dir)
    history = result["history"]
    scored.update(
        seed=seed,
        iterations=iters,
        final_loss=history[-1]["loss"] if history else None,
        fresh=task.fresh,
        parameters=count_parameters(result["trainer"], vocab_size=ctx.model_cfg.vocab_size),  # a collective
    )
    return scored


def _median(runs: list[dict[str, Any]]) -> dict[str, float]:
    keys = runs[0]["metrics"].keys()
    return {k: float(statistics.median(r["metrics"][k] for r in runs)) for k in keys}


def _print_table(task: str, metrics: dict[str, float], runs: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"mlm-finetune {task}" + (f" (median of {len(runs)} seeds)" if len(runs) > 1 else ""))
    table.add_column("metric")
    table.add_column("value", justify="right")
    if len(runs) > 1:
        for r in runs:
            table.add_column(f"seed {r['seed']}", justify="right")
    for name, value in metrics.items():
        table.add_row(
            name, f"{value:.2f}", *([f"{r['metrics'][name]:.2f}" for r in runs] if len(runs) > 1 else [])
        )
    Console(file=sys.stdout).print(table)


@cli_entry
def main(argv: list[str] | None = None) -> int:
    given = list(argv if argv is not None else sys.argv[1:])
    if given[:1] == ["sft"]:  # decoders: supervised fine-tuning (finetune/sft/)
        from finetune.sft.cli import main as sft_main

        return sft_main(given[1:])
    args = build_parser().parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    args.data_dir = resolve_data_dir(args.data_dir)  # builtin:NAME -> the packaged directory
    flags_from_namespace(DTypeFlags, args).dtype_name()  # --bf16 with --fp16 is refused before any work
    check_task_files(args.task, args.data_dir)  # a missing directory first, not a flag it makes moot
    _check_outputs(args)
    if args.eval_only:
        pre = _eval_only_source(args)
        args = _with_saved_hyperparameters(args, args.saved_argv)
    h = hyperparameters_from_args(args)
    if not args.eval_only:
        pre = load_pretrained(
            ckpt=args.ckpt, hf_model=args.hf_model, tokenizer_dir=args.tokenizer_dir, vocab_file=args.vocab_file,
            lower_case=not args.cased, force_tokenizer=getattr(args, "force_tokenizer", False))  # fmt: skip
    cfg = _model_cfg(args, pre, h.seq_length)
    parallel, dp = _parallel(args, cfg)
    micro = args.micro_batch_size or max(1, min(8, h.global_batch_size // dp))
    TrainingConfig(micro_batch_size=micro, global_batch_size=h.global_batch_size, train_iters=0,
                   seq_length=h.seq_length).num_microbatches(dp)  # fmt: skip
    encoder = PairEncoder(pre.tokenizer, h.seq_length)
    data = load_task_data(args.task, args.data_dir, encoder, **({"doc_stride": args.doc_stride,
                          "max_query_length": args.max_query_length, "null_threshold": args.null_score_diff_threshold}
                          if args.task in ("squad", "squad2") else {}))  # fmt: skip
    fingerprint = pre.weights_fingerprint()  # the pretrained trunk's: every rank records it
    record = FinetuneRecord(task=args.task, head=dataclasses.asdict(data.head), source=pre.source,
                            source_fingerprint=fingerprint)  # fmt: skip
    from pretrain.training.loop import setup_parallel

    ps = setup_parallel(parallel, seed=args.seed)
    meta = training_metadata(cfg, parallel, kind="bert", tokenizer=pre.tokenizer, save=None, write_tokenizer=False,
                             finetune=record, argv=list(argv if argv is not None else sys.argv[1:]))  # fmt: skip
    ctx = SeedRunContext(hyper=h, data=data, ps=ps, micro_batch_size=micro, model_cfg=cfg, pretrained=pre,
                         ckpt_args=meta)  # fmt: skip
    runs = [_run_seed(args, k, ctx) for k in range(args.seeds)]
    metrics = _median(runs)
    if ps.rank == 0:
        _report(args, pre, parallel, h, metrics, runs, fingerprint=fingerprint)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def _report(args: argparse.Namespace, pre: Pretrained, parallel: ParallelConfig, h: Hyperparameters, metrics: dict[str, float],
            runs: list[dict[str, Any]], *, fingerprint: str | None) -> None:  # fmt: skip
    task = RESULT_TASK.get(args.task, args.task)
    headline = {k: v for k, v in metrics.items() if k in TASK_METRICS.get(task, metrics)}
    record = make_result(
        kind="finetune", task=task, method="median" if len(runs) > 1 else "single",
        model={"name": pre.name or Path(pre.source).name,
               "iteration": pre.iteration if isinstance(pre.iteration, int) else None,
               "layout": f"tp{parallel.tp}-pp{parallel.pp}-vp{parallel.vp}", "checkpoint": pre.source,
               "parameters": runs[0]["parameters"],  # the finetuned model's (trunk and task head)
               # the pretrained trunk every source of these weights shares (ckpt, HF export, bare BertModel)
               "fingerprint": fingerprint},
        metrics=headline, seed=args.seed, units={k: "percent" for k in headline},  # finetune metrics: x 100
        dtype="bfloat16" if args.bf16 else "float16" if args.fp16 else "float32",
        sample_data=_is_builtin_task(args.data_dir),
        details={"all_metrics": metrics, "hyperparameters": {**dataclasses.asdict(h), "preset": args.preset}, "eval_only": args.eval_only,
                 "data": str(Path(args.data_dir).resolve()),  # the report marks the built-in task data
                 "runs": [{k: r[k] for k in ("seed", "metrics", "details", "iterations", "final_loss", "files")}
                          for r in runs]},
    )  # fmt: skip
    if args.results_dir is not None:
        path = write_result(Path(args.results_dir) / "results.json", record)
        print(f"wrote {path}")
    _print_table(task, metrics, runs)


def _is_builtin_task(data_dir: str) -> bool:
    import finetune.builtin

    try:
        return Path(data_dir).resolve().is_relative_to(Path(finetune.builtin.__file__).resolve().parent)
    except (OSError, ValueError):
        return False


if __name__ == "__main__":
    sys.exit(main())
