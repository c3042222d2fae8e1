"""``python -m finetune.sft.peft_check``: a PEFT adapter, loaded with ``peft``, equals its merged export.

Loads ``--base`` with transformers, applies ``--adapter`` with ``PeftModel.from_pretrained`` and
compares its logits with ``--merged``'s (``mlm-convert to-hf --lora-as adapter`` and ``--lora-as
merged`` of the same LoRA checkpoint) on every conversation of ``--data`` rendered with the base
tokenizer's chat template (default: the built-in chat data). Prints one JSON line
(``max_abs_diff`` adapter vs merged, ``max_abs_change`` merged vs base, ``tokens``); exit 1 when
the adapter differs from the merged model by more than ``--tolerance`` or the merged model equals
the base (an adapter that changes nothing proves nothing), 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from pretrain.utils.cli import OneLineParser
from pretrain.utils.errors import UserError, cli_entry


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m finetune.sft.peft_check", description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, metavar="DIR", help="the Hugging Face base model")
    p.add_argument("--adapter", required=True, metavar="DIR", help="a PEFT LoRA adapter directory")
    p.add_argument("--merged", required=True, metavar="DIR", help="the same adapter merged into the base")
    p.add_argument("--data", metavar="FILE", help='chat JSON lines ({"messages": ...}); default: built-in')
    p.add_argument("--tolerance", type=float, default=1e-5, help="largest |logit difference| allowed")
    return p


def _conversations(path: str | None) -> list[list[dict[str, str]]]:
    from finetune.sft.tiny_tokenizer import SFT_CHAT_FILE

    file = Path(path) if path else SFT_CHAT_FILE
    if not file.is_file():
        raise UserError(f"--data {file}: no such file")
    return [
        json.loads(line)["messages"] for line in file.read_text(encoding="utf-8").splitlines() if line.strip()
    ]


def _load(flag: str, path: str) -> Any:
    from transformers import AutoModelForCausalLM

    if not (Path(path) / "config.json").is_file():
        raise UserError(f"{flag} {path}: not a Hugging Face model directory (no config.json)")
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()


@cli_entry
def main(argv: list[str] | None = None) -> int:
    from peft import PeftModel
    from transformers import AutoTokenizer

    args = build_parser().parse_args(argv)
    if not (Path(args.adapter) / "adapter_config.json").is_file():
        raise UserError(f"--adapter {args.adapter}: not a PEFT adapter directory (no adapter_config.json)")
    chats = _conversations(args.data)
    tok = AutoTokenizer.from_pretrained(args.base, local_files_only=True)
    base = _load("--base", args.base)
    merged = _load("--merged", args.merged)
    base_logits = [_logits(base, tok, c) for c in chats]  # before peft wraps (and changes) the base
    peft: Any = PeftModel.from_pretrained(base, args.adapter).eval()
    diff = change = 0.0
    tokens = 0
    for chat, before in zip(chats, base_logits, strict=True):
        theirs, ours = _logits(peft, tok, chat), _logits(merged, tok, chat)
        diff = max(diff, float((theirs - ours).abs().max()))
        change = max(change, float((ours - before).abs().max()))
        tokens += theirs.shape[0]
    print(json.dumps({"max_abs_diff": diff, "max_abs_change": change, "tokens": tokens,
                      "tolerance": args.tolerance}))  # fmt: skip
    return 0 if diff <= args.tolerance and change > 0 else 1


def _logits(model: Any, tok: Any, chat: list[dict[str, str]]) -> torch.Tensor:
    """``[tokens, vocab]`` float32 logits of one conversation rendered with the chat template."""
    ids = tok.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


if __name__ == "__main__":
    sys.exit(main())
