"""Model selection for ``mlm-eval`` tasks: flags, the :class:`ModelSpec`, and ``load_scorer``.

Today ``--hf-model DIR`` (a local Hugging Face model + tokenizer directory) works end to end.
``--ckpt DIR`` (our Megatron-layout checkpoints, any TP/PP layout) and the Megatron tokenizer
flags are parsed already; :func:`load_scorer` is the one hook where the checkpoint loader plugs in.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlm_eval.scorer import HFCausalLMScorer, LMScorer
from pretrain.utils.errors import UserError


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Which model and tokenizer to evaluate, as given on the command line."""

    hf_model: str | None = None
    ckpt: str | None = None
    tokenizer_type: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_dir: str | None = None
    device: str = "cpu"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ModelSpec:
        """Collect the model flags of a parsed namespace (see :func:`add_model_arguments`)."""
        return cls(
            hf_model=args.hf_model,
            ckpt=args.ckpt,
            tokenizer_type=args.tokenizer_type,
            vocab_file=args.vocab_file,
            merge_file=args.merge_file,
            tokenizer_dir=args.tokenizer_dir,
            device=args.device,
        )


@dataclass(frozen=True, kw_only=True)
class LoadedModel:
    """A scorer, its tokenizer, and the model identity for the result record."""

    scorer: LMScorer
    tokenizer: Any  # a transformers tokenizer or any mlm_eval.scorer.TextEncoder
    info: dict[str, Any]  # make_result's "model": name, parameters, iteration, layout, checkpoint


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the model-selection flags shared by every evaluation subcommand."""
    group = parser.add_argument_group("model")
    source = group.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--hf-model", metavar="DIR", help="local Hugging Face causal LM + tokenizer directory"
    )
    source.add_argument("--ckpt", metavar="DIR", help="an mlm-toolkit (Megatron-layout) checkpoint directory")
    group.add_argument(
        "--tokenizer-type", help="Megatron tokenizer type, e.g. GPT2BPETokenizer (with --ckpt)"
    )
    group.add_argument("--vocab-file", metavar="PATH", help="tokenizer vocabulary file (with --ckpt)")
    group.add_argument("--merge-file", metavar="PATH", help="BPE merges file (with --ckpt)")
    group.add_argument(
        "--tokenizer-dir", metavar="DIR", help="a Hugging Face tokenizer directory to use instead"
    )
    group.add_argument("--device", default="cpu", help="torch device to run on (default: cpu)")
    group.add_argument(
        "--name", default=None, help="model name in the result record (default: directory name)"
    )


def load_scorer(args: argparse.Namespace) -> LoadedModel:
    """Build the scorer and tokenizer the flags select (THE hook for the checkpoint loader).

    ``--ckpt`` (with ``--tokenizer-*`` and TP/PP flags) is to be wired here once the
    checkpoint tools can load our layouts; until then it is a clear user error.
    """
    spec = ModelSpec.from_args(args)
    if spec.ckpt is not None:
        return _load_ckpt(spec, args)
    if spec.hf_model is None:
        raise UserError("one of --hf-model DIR or --ckpt DIR is required")
    megatron_flags = {"--tokenizer-type": spec.tokenizer_type, "--vocab-file": spec.vocab_file}
    megatron_flags["--merge-file"] = spec.merge_file
    given = [flag for flag, value in megatron_flags.items() if value is not None]
    if given:  # silently ignoring them would evaluate with a different tokenizer than asked
        raise UserError(f"{', '.join(given)} apply to --ckpt; with --hf-model use --tokenizer-dir DIR")
    loaded = load_hf_model(spec, batch_size=args.batch_size)
    if getattr(args, "name", None):
        loaded.info["name"] = args.name
    return loaded


def _load_ckpt(spec: ModelSpec, args: argparse.Namespace) -> LoadedModel:
    """Our/upstream Megatron checkpoint of any layout, resharded in memory to one process."""
    from mlm_eval.megatron_scorer import load_megatron_gpt
    from pretrain.tokenizer.factory import TokenizerConfig

    tok_cfg = None
    if spec.tokenizer_type is not None:
        tok_cfg = TokenizerConfig(tokenizer_type=spec.tokenizer_type, vocab_file=spec.vocab_file,
                                  merge_file=spec.merge_file, model_path=spec.tokenizer_dir)  # fmt: skip
    scorer, encoder, info = load_megatron_gpt(str(spec.ckpt), tokenizer_cfg=tok_cfg, batch_size=args.batch_size,
                                              device=spec.device)  # fmt: skip
    if getattr(args, "name", None):
        info["name"] = args.name
    return LoadedModel(scorer=scorer, tokenizer=encoder, info=info)


def load_hf_model(spec: ModelSpec, *, batch_size: int) -> LoadedModel:
    """Load ``spec.hf_model`` (offline) as an :class:`HFCausalLMScorer` and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # lazy: slow import
    from transformers.utils import logging as hf_logging

    model_dir = Path(str(spec.hf_model))
    tokenizer_dir = Path(spec.tokenizer_dir) if spec.tokenizer_dir else model_dir
    for flag, path in (("--hf-model", model_dir), ("--tokenizer-dir", tokenizer_dir)):
        if not path.is_dir():
            raise UserError(f"{flag} {path}: not a directory")
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise UserError(f"{tokenizer_dir}: cannot load a tokenizer ({_first_line(exc)})") from None
    bars_were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a weight-loading bar per run is noise in an eval's output
    try:
        model: Any = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
        model = model.to(spec.device)
    except (OSError, ValueError, RuntimeError) as exc:
        raise UserError(f"--hf-model {model_dir}: cannot load a causal LM ({_first_line(exc)})") from None
    finally:
        if bars_were_on:
            hf_logging.enable_progress_bar()
    vocab = min(len(tokenizer), int(model.config.vocab_size))  # rows past the tokenizer are padding
    scorer = HFCausalLMScorer(model, batch_size=batch_size, vocab_size=vocab)
    info = {
        "name": model_dir.resolve().name,
        "parameters": sum(p.numel() for p in model.parameters()),
        "iteration": None,
        "layout": None,
        "checkpoint": os.fspath(model_dir.resolve()),
    }
    return LoadedModel(scorer=scorer, tokenizer=tokenizer, info=info)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
