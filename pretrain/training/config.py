"""Training-loop configuration (batching, iterations, logging, checkpoints)."""

from __future__ import annotations

from dataclasses import dataclass

from pretrain.utils.errors import UserError


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """Global batch = micro batch x microbatches x data-parallel size (Megatron's rule)."""

    micro_batch_size: int
    global_batch_size: int
    train_iters: int
    seq_length: int
    seed: int = 1234
    log_interval: int = 1
    eval_interval: int = 0  # 0: no periodic validation
    eval_iters: int = 10
    save: str | None = None
    load: str | None = None
    save_interval: int = 0  # 0: save only at the end (when --save is given)
    finetune: bool = False  # load weights only, start at iteration 0
    no_load_optim: bool = False
    no_load_rng: bool = False
    log_json: str | None = None
    schedule: str = "1f1b"
    overlap_grad_reduce: bool = False
    progress: bool = True
    override_opt_param_scheduler: bool = False  # resume with this run's LR flags, not the checkpoint's
    use_checkpoint_opt_param_scheduler: bool = False  # resume with the checkpoint's LR schedule
    exit_interval: int = 0  # save (with --save) and stop when the iteration is a multiple of this
    exit_duration_in_mins: float = 0.0  # save and stop once training has run this long (0: never)
    exit_signal_handler: bool = False  # SIGTERM: save and stop after the current iteration

    def __post_init__(self) -> None:
        for name in ("micro_batch_size", "global_batch_size", "seq_length", "log_interval"):
            if getattr(self, name) <= 0:
                raise UserError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        for name in ("train_iters", "eval_interval", "eval_iters", "save_interval", "exit_interval",
                     "exit_duration_in_mins"):  # fmt: skip
            if getattr(self, name) < 0:
                raise UserError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise UserError(
                "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler exclude each other"
            )
        if self.schedule not in ("1f1b", "fthenb"):
            raise UserError(f"--pipeline-schedule must be 1f1b or fthenb, got {self.schedule!r}")

    def num_microbatches(self, dp: int) -> int:
        """Microbatches per iteration on each data-parallel rank; checks divisibility."""
        per_step = self.micro_batch_size * dp
        if self.global_batch_size % per_step:
            raise UserError(
                f"--global-batch-size {self.global_batch_size} is not divisible by --micro-batch-size "
                f"{self.micro_batch_size} x data-parallel size {dp} = {per_step}"
            )
        return self.global_batch_size // per_step
