"""The demo's SFT + LoRA step (``make demo``, step 7): seconds on CPU.

A tiny random Llama with the built-in chat tokenizer (``finetune.sft.tiny_model``) gets LoRA
adapters trained on the built-in chat data (``--data builtin:sft_chat``) at tp=2 under
``torchrun`` (gloo); the LoRA checkpoint is exported both as a PEFT adapter and merged, and
``tools.peft_check`` loads the adapter with ``peft`` and compares it with the merged model.
The SFT result goes to ``out/sft_lora_results`` (beside, not into, the leaderboard's results).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

Run = Callable[..., None]


def sft_lora(out: Path, run: Run, tool: Callable[[str], str]) -> None:
    """Train, export and check; ``run(title, cmd)`` runs one command, ``tool(name)`` finds a script."""
    if importlib.util.find_spec("peft") is None:
        print("\n=== SFT + LoRA: peft not installed (pip install -e '.[dev]'), step skipped")
        return
    from finetune.sft.tiny_model import write_tiny_chat_llama

    base = write_tiny_chat_llama(out / "chat_llama")
    lora = out / "sft_lora"
    run("LoRA SFT on the built-in chat data with tp=2 (torchrun, gloo)", [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "finetune.cli", "sft",
        "--hf-model", str(base), "--data", "builtin:sft_chat", "--tp", "2", "--lora-rank", "8",
        "--lora-alpha", "16", "--seq-length", "128", "--pack", "--epochs", "4", "--lr", "1e-2",
        "--global-batch-size", "8", "--micro-batch-size", "4", "--save", str(lora),
        "--results-dir", str(out / "sft_lora_results"), "--no-progress",
    ])  # fmt: skip
    convert = tool("mlm-convert")
    run("export the LoRA adapter for PEFT", [convert, "to-hf", "--load", str(lora), "--save",
        str(out / "sft_adapter"), "--lora-as", "adapter"])  # fmt: skip
    run("export the adapter merged into its base", [convert, "to-hf", "--load", str(lora), "--save",
        str(out / "sft_merged"), "--lora-as", "merged"])  # fmt: skip
    run("load the adapter with peft: equals the merged model", [sys.executable, "-m", "tools.peft_check",
        "--base", str(base), "--adapter", str(out / "sft_adapter"), "--merged", str(out / "sft_merged")])  # fmt: skip
