"""``mlm-generate``: text from a checkpoint of any layout (or a Hugging Face model), for people and machines.

Examples::

    mlm-generate --ckpt ckpt --prompt "The quick brown fox" --max-new-tokens 40
    mlm-generate --ckpt ckpt --prompts prompts.jsonl --temperature 0.8 --top-p 0.95 --seed 7 --json
    torchrun --nproc-per-node 4 -m mlm_eval.generation.cli --ckpt ckpt --tp 2 --pp 2 --prompt "Hello"
    torchrun --nproc-per-node 2 -m mlm_eval.generation.cli --ckpt moe_ckpt --ep 2 --prompts p.jsonl --json
    mlm-generate --hf-model hf_dir --prompt "Hello" --stop "."

Greedy unless ``--temperature`` > 0. Without ``--json`` each prompt's text streams to the
terminal as it is generated; with ``--json`` every prompt gives one JSON line ``{"index",
"prompt", "text", "tokens", "stopped"}`` in input order (prompts batched ``--batch-size`` at a time,
split over data-parallel replicas under torchrun; a mixture-of-experts checkpoint may split its
experts over ``--ep`` ranks, ``--etp`` 1 or TP, as ``mlm-eval``). ``--prompts`` reads JSON lines with a
``"prompt"`` (or ``"text"``) field. The output is cut before the first ``--stop`` string.
``--apply-chat-template`` sends each prompt as one user message rendered with the tokenizer's chat
template and the assistant's turn opened (transformers' ``apply_chat_template(...,
add_generation_prompt=True)``); ``--chat-template FILE`` renders with that template instead.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from mlm_eval.generation.hf import run_hf
from mlm_eval.generation.stream import TextStream, cut_at_stop
from pretrain.config import DTypeFlags
from pretrain.inference.generate import GenerationConfig
from pretrain.inference.sampling import SamplingConfig
from pretrain.parallel.config import ParallelConfig
from pretrain.tokenizer.chat import read_template_file, render_chat
from pretrain.tokenizer.flags import TokenizerFlags
from pretrain.utils.cli import OneLineParser
from pretrain.utils.errors import UserError, cli_entry
from pretrain.utils.flag_groups import add_flag_group, flags_from_namespace
from pretrain.utils.jsonl import iter_json_objects

if TYPE_CHECKING:
    from mlm_eval.scoring.megatron import TokenizerChoice


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="mlm-generate", description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--ckpt", metavar="DIR", help="a Megatron-layout checkpoint (any layout and era)")
    src.add_argument(
        "--hf-model", metavar="DIR", help="a local Hugging Face causal LM directory (one process)"
    )
    text = p.add_mutually_exclusive_group(required=True)
    text.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    text.add_argument("--prompts", metavar="FILE", help='JSON lines with a "prompt" (or "text") field')
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1234, help="sampling seed (prompt i uses seed + i)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--no-cache", action="store_true", help="recompute every position each step (reference)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--json", action="store_true", help="one JSON line per prompt instead of streaming text")
    p.add_argument("--device", default="cpu", help="torch device to run on (default: cpu)")
    p.add_argument("--apply-chat-template", action="store_true",
                   help="send each prompt as a user message in the tokenizer's chat template")  # fmt: skip
    p.add_argument("--chat-template", metavar="FILE",
                   help="a Jinja chat template to render prompts with (implies --apply-chat-template)")  # fmt: skip
    add_flag_group(p, DTypeFlags, title="dtype", include=("dtype",))
    add_flag_group(
        p, ParallelConfig, title="parallel layout (torchrun)", include=("tp", "pp", *ParallelConfig.EXPERT)
    )
    tok = p.add_argument_group("tokenizer (default: the checkpoint's own)")
    add_flag_group(p, TokenizerFlags, title="tokenizer", group=tok)
    return p


def tokenizer_choice(flags: TokenizerFlags) -> TokenizerChoice | None:
    """The tokenizer the flags name (Megatron's flags or ``--tokenizer-dir``, checked against the
    checkpoint's unless ``--force-tokenizer``), or ``None`` for the checkpoint's own."""
    from mlm_eval.scoring.megatron import TokenizerChoice

    megatron = flags.megatron_config()
    directory = None if flags.tokenizer_dir is None else str(flags.tokenizer_dir)
    if megatron is None and directory is None:
        return None
    return TokenizerChoice(megatron=megatron, directory=directory, force=flags.force_tokenizer)


def read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompt:
        return list(args.prompt)
    path = Path(args.prompts)
    if not path.is_file():
        raise UserError(f"--prompts {path}: no such file")
    out = []
    for n, row in iter_json_objects(path, flag="--prompts"):
        value = row.get("prompt", row.get("text"))
        if not isinstance(value, str):
            raise UserError(f'{path}:{n}: needs a string "prompt" (or "text") field')
        out.append(value)
    if not out:
        raise UserError(f"--prompts {path}: no prompts")
    return out


def chat_template_text(args: argparse.Namespace) -> str | None:
    """``--chat-template FILE``'s text (checked before any model is read), else ``None``."""
    return None if args.chat_template is None else read_template_file(args.chat_template)


def sampling_config(args: argparse.Namespace) -> SamplingConfig:
    greedy = args.temperature == 0.0
    if args.temperature < 0:
        raise UserError(f"--temperature must be >= 0, got {args.temperature}")
    return SamplingConfig(greedy=greedy, temperature=args.temperature if not greedy else 1.0, top_k=args.top_k,
                          top_p=args.top_p, seed=args.seed)  # fmt: skip


@cli_entry
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.max_new_tokens < 1 or args.batch_size < 1:
        raise UserError("--max-new-tokens and --batch-size must be >= 1")
    for dest, flag in (("tp", "tensor"), ("pp", "pipeline"), ("ep", "expert")):  # before the layout's checks
        if getattr(args, dest) < 1:
            raise UserError(f"--{flag}-model-parallel-size must be >= 1, got {getattr(args, dest)}")
    parallel = flags_from_namespace(ParallelConfig, args)
    dtype = flags_from_namespace(DTypeFlags, args)
    tok_flags = flags_from_namespace(TokenizerFlags, args)
    tok_cfg = tokenizer_choice(tok_flags)
    prompts = read_prompts(args)
    sampling = sampling_config(args)
    args.chat_template_text = chat_template_text(args)
    args.apply_chat_template = args.apply_chat_template or args.chat_template_text is not None
    if args.hf_model:
        if tok_cfg is not None:
            flag = "--tokenizer-type" if tok_flags.tokenizer_type else "--tokenizer-dir"
            raise UserError(f"{flag} is for --ckpt; --hf-model uses the directory's tokenizer")
        return run_hf(args, prompts, sampling, parallel=parallel, dtype=dtype)
    return _run_ckpt(args, prompts, sampling, parallel=parallel, dtype=dtype, tok_cfg=tok_cfg)


def _run_ckpt(
    args: argparse.Namespace,
    prompts: list[str],
    sampling: SamplingConfig,
    *,
    parallel: ParallelConfig,
    dtype: DTypeFlags,
    tok_cfg: TokenizerChoice | None,
) -> int:
    from mlm_eval.harness.engine import EngineConfig, HarnessEngine
    from pretrain.inference.generate import generate

    engine = HarnessEngine.load(EngineConfig(ckpt=args.ckpt, parallel=parallel, device=args.device,
                                             dtype=dtype.dtype_name(), batch_size=args.batch_size, tokenizer=tok_cfg,
                                             progress=False))  # fmt: skip
    try:
        tok = engine.tokenizer
        room = engine.max_length - args.max_new_tokens
        if room < 1:
            raise UserError(
                f"--max-new-tokens {args.max_new_tokens} leaves no room in {engine.max_length} positions"
            )
        texts = prompts
        if args.apply_chat_template:
            source = args.chat_template or f"--ckpt {args.ckpt}"
            texts = [render_chat(tok, [{"role": "user", "content": p}], template=args.chat_template_text,
                                 source=source) for p in prompts]  # fmt: skip
        ids = [list(tok.tokenize(t))[-room:] or [int(tok.eod or 0)] for t in texts]
        gen = GenerationConfig(max_new_tokens=args.max_new_tokens, sampling=sampling, use_cache=not args.no_cache,
                               eos_id=tok.eod, pad_id=int(tok.eod or 0))  # fmt: skip

        def stop(_: int, out: list[int]) -> bool:
            return cut_at_stop(tok.text_of(out), args.stop)[1]

        if args.json:
            outs = engine.generate(ids, gen, stop=stop if args.stop else None)
            for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
                text, stopped = cut_at_stop(tok.text_of(out), args.stop)
                if engine.is_main:
                    print(json.dumps({"index": i, "prompt": prompt, "text": text, "tokens": out,
                                      "stopped": stopped}), flush=True)  # fmt: skip
            return 0
        for i, (prompt, row) in enumerate(zip(prompts, ids, strict=True)):
            stream = TextStream(tok.text_of, args.stop, show=engine.is_main)
            stream.start(prompt)
            generate(
                engine.model, [row], gen, stop=stop if args.stop else None, seeds=[i], on_token=stream.add
            )
            stream.finish()
        return 0
    finally:
        engine.close()


if __name__ == "__main__":
    sys.exit(main())
