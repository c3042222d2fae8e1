"""One SFT run on the training loop: train (unless ``--eval-only``), ``valid_loss``, save, report."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from finetune.sft.task import SFTTask, valid_loss
from finetune.tasks import train_iterations
from pretrain.optim.config import LRScheduleConfig, OptimizerConfig
from pretrain.training.config import TrainingConfig

if TYPE_CHECKING:
    from finetune.sft.data import SFTData
    from finetune.sft.samples import SampleSet
    from finetune.sft.source import Decoder
    from pretrain.config import ModelConfig
    from pretrain.models.lora import LoraConfig
    from pretrain.parallel.config import ParallelConfig
    from pretrain.parallel.state import ParallelState


def _configs(
    args: argparse.Namespace, data: SFTData, seq_length: int, dp: int, *, lora: bool
) -> tuple[TrainingConfig, OptimizerConfig, LRScheduleConfig]:
    rows = data.train_rows
    iters = 0 if rows is None else train_iterations(len(rows["tokens"]), args.epochs, args.global_batch_size)
    micro = args.micro_batch_size or max(1, min(8, args.global_batch_size // dp))
    train_cfg = TrainingConfig(
        micro_batch_size=micro, global_batch_size=args.global_batch_size, train_iters=iters, seq_length=seq_length,
        seed=args.seed, log_interval=args.log_interval, save=args.save, finetune=True, log_json=args.log_json,
        schedule=args.pipeline_schedule, overlap_grad_reduce=args.overlap_grad_reduce,
        progress=not args.no_progress and iters > 0,
    )  # fmt: skip
    train_cfg.num_microbatches(dp)  # divisibility, before any process group
    # LoRA: the optimizer sees only the float32 adapters (the bf16 base is frozen)
    half = {"fp16": args.fp16 and not lora, "bf16": args.bf16 and not lora}
    optim = OptimizerConfig(lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay, clip_grad=args.clip_grad,
                            use_distributed_optimizer=args.use_distributed_optimizer, **half)  # fmt: skip
    lr = (LRScheduleConfig(lr=args.lr, min_lr=args.lr, decay_style="constant") if iters == 0 else
          LRScheduleConfig(lr=args.lr, min_lr=args.min_lr if args.lr_decay_style != "constant" else args.lr,
                           decay_style=args.lr_decay_style, warmup_iters=int(args.lr_warmup_fraction * iters),
                           decay_iters=iters))  # fmt: skip
    return train_cfg, optim, lr


def describe(flag: str, s: SampleSet, rows: int, pack: bool) -> str:
    """One line: what encoding did to a file's records."""
    skipped = ""
    if s.skipped:
        shown = ", ".join(s.skipped[:3]) + (", ..." if len(s.skipped) > 3 else "")
        skipped = f", {len(s.skipped)} skipped with no loss token ({shown})"
    return (f"{flag}: {s.records} records -> {len(s.samples)} samples, {s.loss_tokens} loss tokens, "
            f"{s.truncated} truncated to --seq-length{skipped}; {rows} {'packed ' if pack else ''}sequences")  # fmt: skip


def _save_tokenizer(directory: Path, dec: Decoder, data: SFTData) -> None:
    """The tokenizer beside the checkpoint; with ``--chat-template FILE``, that template (the one the
    model was trained on) replaces the tokenizer's own in a Hugging Face tokenizer's files."""
    from pretrain.tokenizer.hf import HuggingFaceTokenizer
    from pretrain.tokenizer.loader import save_tokenizer
    from pretrain.utils.atomic import atomic_open

    save_tokenizer(dec.tokenizer, directory)
    template = data.template
    if template is not None and template.from_file and isinstance(dec.tokenizer, HuggingFaceTokenizer):
        with atomic_open(directory / "chat_template.jinja", "w") as fh:
            fh.write(template.text)


def run_sft(args: argparse.Namespace, dec: Decoder, cfg: ModelConfig, parallel: ParallelConfig, data: SFTData, *,
            seq_length: int, dp: int, lora: LoraConfig | None = None) -> int:  # fmt: skip
    """Train and evaluate on this launch's ranks; rank 0 prints and writes ``results.json``."""
    import torch.distributed as dist

    from pretrain.checkpoint.args import training_metadata
    from pretrain.checkpoint.types import FinetuneRecord
    from pretrain.training.loop import count_parameters, setup_parallel, train

    train_cfg, optim, lr = _configs(args, data, seq_length, dp, lora=lora is not None)
    ps = setup_parallel(parallel, seed=args.seed)
    if ps.rank == 0:
        for flag, s, r in (
            ("--data", data.train, data.train_rows),
            ("validation", data.valid, data.valid_rows),
        ):
            if s is not None and r is not None:
                print(describe(flag, s, len(r["tokens"]), args.pack))
    record = FinetuneRecord(task="sft", head={}, source=dec.source, source_fingerprint=dec.fingerprint)
    meta = training_metadata(cfg, parallel, kind="gpt", tokenizer=dec.tokenizer, save=None, write_tokenizer=False,
                             finetune=record, argv=args.argv)  # fmt: skip
    rows = data.train_rows if data.train_rows is not None else data.valid_rows
    assert rows is not None
    task = SFTTask(model_cfg=cfg, train_cfg=train_cfg, rows=rows, pretrained=dec.tensors, lora=lora,
                   lora_base=None if lora is None else dec.base_of(), adapter=dec.adapter)  # fmt: skip
    result = train(task, ps=ps, optim_cfg=optim, lr_cfg=lr, cfg=train_cfg, ckpt_args=meta)
    if args.save is not None and ps.rank == 0:
        _save_tokenizer(Path(args.save) / "tokenizer", dec, data)
    params = count_parameters(result["trainer"], vocab_size=cfg.vocab_size)  # a collective
    valid = None
    if data.valid_rows is not None:
        valid = valid_loss(task.chunks, ps, data.valid_rows, train_cfg.micro_batch_size)
    if ps.rank == 0:
        _report(args, dec, ps, data, result, valid, params, lora, cpu_gemm=_cpu_gemm_ran(cfg, ps))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def _cpu_gemm_ran(cfg: ModelConfig, ps: ParallelState) -> str | None:
    """The library the frozen fp32 base GEMMs ran with (``--cpu-gemm`` resolved), None on a GPU."""
    from pretrain.models.cpu_gemm import resolve

    return resolve(cfg.cpu_gemm) if ps.device.type == "cpu" else None


def _report(args: argparse.Namespace, dec: Decoder, ps: ParallelState, data: SFTData, result: dict[str, Any],
            valid: tuple[float, int] | None, params: int, lora: LoraConfig | None, *,
            cpu_gemm: str | None) -> None:  # fmt: skip
    from pretrain.utils.results import make_result, write_result

    history = result["history"]
    dtype = "bfloat16" if args.bf16 else "float16" if args.fp16 else "float32"
    layout = f"tp{ps.tp_size}-pp{ps.pp_size}-dp{ps.dp_size}"
    sets = {"train": data.train, "valid": data.valid}
    details = {
        "valid_loss": None if valid is None else valid[0], "valid_loss_tokens": None if valid is None else valid[1],
        "truncated_samples": {k: s.truncated for k, s in sets.items() if s is not None},
        "skipped_no_loss_token": {k: list(s.skipped) for k, s in sets.items() if s is not None},
        "samples": {k: len(s.samples) for k, s in sets.items() if s is not None},
        "loss_tokens": {k: s.loss_tokens for k, s in sets.items() if s is not None},
        "template_sha256": None if data.template is None else data.template.sha256,
        "template_source": None if data.template is None else data.template.source,
        "loss_on": data.loss_on, "pack": args.pack, "lora": None if lora is None else lora.to_dict(), "layout": layout, "dtype": dtype,
        "fused_kernels": bool(args.fused_kernels), "cpu_gemm": cpu_gemm, "eval_only": args.eval_only, "iterations": result["final_iteration"],
        "final_loss": history[-1]["loss"] if history else None, "train_losses": [h["loss"] for h in history],
        "hyperparameters": {k: getattr(args, k) for k in ("epochs", "global_batch_size", "micro_batch_size", "lr",
                            "min_lr", "lr_decay_style", "lr_warmup_fraction", "weight_decay", "clip_grad", "seed")},
    }  # fmt: skip
    metrics = {} if valid is None else {"valid_loss": valid[0], "valid_loss_tokens": valid[1]}
    rec = make_result(kind="finetune", task="sft", method="single", dtype=dtype, seed=args.seed, metrics=metrics,
                      model={"name": dec.name, "iteration": dec.iteration, "layout": layout, "checkpoint": dec.source,
                             "parameters": params,
                             "fingerprint": dec.fingerprint},
                      sample_data=args.data in ("builtin:sft_chat", "builtin:sft_completion"), details=details)  # fmt: skip
    if valid is not None:
        print(f"valid_loss {valid[0]:.6f} over {valid[1]} loss tokens ({layout}, {dtype})")
    if args.results_dir is not None:
        print(f"wrote {write_result(Path(args.results_dir) / 'results.json', rec)}")
