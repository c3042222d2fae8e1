"""Per-iteration logging: a progress bar (on a terminal) and lines for people, JSON lines for machines (rank 0)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm


class TrainingLogger:
    """Writes on global rank 0 only; other ranks get a silent logger."""

    def __init__(self, *, enabled: bool, total: int, start: int, log_interval: int, json_path: str | None,
                 progress: bool) -> None:  # fmt: skip
        self.enabled, self.log_interval = enabled, log_interval
        # A bar only where a person watches (a terminal); logs and batch jobs get the plain lines.
        bar = enabled and progress and sys.stderr.isatty()
        self.bar = tqdm(total=total, initial=start, desc="train", unit="it", disable=not bar,
                        dynamic_ncols=True)  # fmt: skip
        self.json = None
        if enabled and json_path:
            Path(json_path).parent.mkdir(parents=True, exist_ok=True)
            self.json = open(json_path, "a", encoding="utf-8")  # noqa: SIM115 (kept open for the run)

    def iteration(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}")
        if self.json is not None:
            self.json.write(json.dumps(record) + "\n")
            self.json.flush()
        if record["iteration"] % self.log_interval == 0:
            gn = record.get("grad_norm")
            parts = "".join(
                f"{k} {v:.6f} | " for k, v in record.items() if k.endswith(" loss") and k != "loss"
            )
            self.write(
                f"iter {record['iteration']:>6} | loss {record['loss']:.6f} | {parts}lr {record['lr']:.3e} | "
                f"grad norm {gn if gn is None else f'{gn:.3f}'} | loss scale {record['loss_scale']:.1f} | "
                f"skipped {record['skipped_iterations']} | {record['tokens_per_s']:.0f} tok/s | "
                f"{record['tflops_per_rank']:.3f} TFLOP/s/rank"
            )
            if "tokens_per_expert" in record:
                self._router_lines(record)

    def _router_lines(self, record: dict[str, Any]) -> None:
        """Mixture of experts: the router losses, then each MoE layer's tokens per expert."""
        self.write(
            f"  router | load balancing loss {record['load_balancing_loss']:.6f} | z loss {record['z_loss']:.6f} | "
            f"dropped tokens {record['dropped_tokens']}"
        )
        for layer, counts in record["tokens_per_expert"].items():
            self.write(f"  layer {layer:>3} tokens per expert: {' '.join(str(c) for c in counts)}")

    def validation(self, iteration: int, loss: float, split: str = "valid") -> None:
        if not self.enabled:
            return
        ppl = math.exp(min(loss, 20.0))
        self.write(f"{split} at iter {iteration}: loss {loss:.6f} | ppl {ppl:.3f}")
        if self.json is not None:
            self.json.write(
                json.dumps({"iteration": iteration, f"{split}_loss": loss, f"{split}_ppl": ppl}) + "\n"
            )
            self.json.flush()

    def write(self, line: str) -> None:
        if self.enabled:
            self.bar.write(line)

    def close(self) -> None:
        self.bar.close()
        if self.json is not None:
            self.json.close()
