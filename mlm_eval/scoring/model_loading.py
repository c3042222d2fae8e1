"""Model selection for ``mlm-eval`` tasks: flags, the :class:`ModelSpec`, and ``load_scorer``.

``--hf-model DIR`` (a local Hugging Face model + tokenizer directory) or ``--ckpt DIR`` (our or
upstream Megatron-layout checkpoints, any TP/PP/VP layout): in one process (resharded in memory),
or under ``torchrun`` with ``--tensor-model-parallel-size``/``--pipeline-model-parallel-size``
and, for mixture-of-experts checkpoints, ``--ep``/``--etp`` (data parallel over the remaining ranks, :mod:`mlm_eval.scoring.parallel`). ``--dtype`` casts
the model's weights; log-probabilities are always accumulated in float64.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlm_eval.scoring.scorer import DTYPE_FLAGS, HFCausalLMScorer, LMScorer
from pretrain.config import DTypeFlags
from pretrain.parallel.config import ParallelConfig
from pretrain.tokenizer.flags import TokenizerFlags
from pretrain.utils.errors import UserError
from pretrain.utils.flag_groups import add_flag_group, flags_from_namespace

# mlm-eval keeps Megatron's attribute names for the parallel sizes (torchrun launch scripts read them)
PARALLEL_DESTS = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size"}


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Which model and tokenizer to evaluate, as given on the command line."""

    hf_model: str | None = None
    ckpt: str | None = None
    tokenizer_type: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_model: str | None = None
    tokenizer_dir: str | None = None
    device: str = "cpu"
    dtype: str = "float32"  # a pretrain.models.transformer.DTYPES name
    parallel: ParallelConfig = ParallelConfig()  # the TP/PP layout under torchrun
    force_tokenizer: bool = False  # use a flag's tokenizer that differs from the checkpoint's

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ModelSpec:
        """Collect the model flags of a parsed namespace (see :func:`add_model_arguments`)."""
        tok = flags_from_namespace(TokenizerFlags, args)
        return cls(
            hf_model=args.hf_model,
            ckpt=args.ckpt,
            tokenizer_type=tok.tokenizer_type,
            vocab_file=tok.vocab_file,
            merge_file=tok.merge_file,
            tokenizer_model=tok.tokenizer_model,
            tokenizer_dir=None if tok.tokenizer_dir is None else str(tok.tokenizer_dir),
            device=args.device,
            dtype=DTYPE_FLAGS[flags_from_namespace(DTypeFlags, args).dtype],
            parallel=flags_from_namespace(ParallelConfig, args, dests=PARALLEL_DESTS),
            force_tokenizer=tok.force_tokenizer,
        )


def _nothing() -> None:
    return None


@dataclass(frozen=True, kw_only=True)
class LoadedModel:
    """A scorer, its tokenizer, and the model identity for the result record."""

    scorer: LMScorer
    tokenizer: Any  # a transformers tokenizer or any mlm_eval.scoring.scorer.TextEncoder
    info: dict[str, Any]  # make_result's "model": name, parameters, iteration, layout, checkpoint
    is_main: bool = True  # the rank that prints and writes the result
    layout: str = "tp1-pp1-dp1"  # how this evaluation runs (the checkpoint's own is in info)
    dtype: str = "float32"
    close: Callable[[], None] = _nothing  # releases the process group under torchrun


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the model-selection flags shared by every evaluation subcommand."""
    group = parser.add_argument_group("model")
    source = group.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--hf-model", metavar="DIR", help="local Hugging Face causal LM + tokenizer directory"
    )
    source.add_argument("--ckpt", metavar="DIR", help="an mlm-toolkit (Megatron-layout) checkpoint directory")
    add_flag_group(parser, TokenizerFlags, title="tokenizer", group=group)
    group.add_argument("--device", default="cpu", help="torch device to run on (default: cpu)")
    add_flag_group(parser, DTypeFlags, title="dtype", group=group, include=("dtype",))
    add_flag_group(
        parser,
        ParallelConfig,
        title="parallel",
        group=group,
        include=("tp", "pp", *ParallelConfig.EXPERT),
        dests=PARALLEL_DESTS,
    )
    group.add_argument(
        "--name", default=None, help="model name in the result record (default: directory name)"
    )


def load_scorer(args: argparse.Namespace) -> LoadedModel:
    """Build the scorer and tokenizer the flags select (in parallel under torchrun, see module doc)."""
    check_device(args.device)
    for dest in PARALLEL_DESTS.values():  # mlm-eval's wording, before the layout's own checks
        if getattr(args, dest) < 1:
            raise UserError(f"--{dest.replace('_', '-')} must be >= 1, got {getattr(args, dest)}")
    spec = ModelSpec.from_args(args)
    if spec.ckpt is not None:
        return _load_ckpt(spec, args)
    if spec.hf_model is None:
        raise UserError("one of --hf-model DIR or --ckpt DIR is required")
    from mlm_eval.scoring.parallel import launched_distributed

    if spec.parallel.model_parallel_size > 1 or spec.parallel.ep > 1 or launched_distributed():
        raise UserError("--hf-model runs in one process; TP/PP/DP/EP evaluation (torchrun) needs --ckpt DIR")
    megatron_flags = {"--tokenizer-type": spec.tokenizer_type, "--vocab-file": spec.vocab_file}
    megatron_flags["--merge-file"] = spec.merge_file
    megatron_flags["--tokenizer-model"] = spec.tokenizer_model
    given = [flag for flag, value in megatron_flags.items() if value is not None]
    if given:  # silently ignoring them would evaluate with a different tokenizer than asked
        raise UserError(f"{', '.join(given)} apply to --ckpt; with --hf-model use --tokenizer-dir DIR")
    loaded = load_hf_model(spec, batch_size=args.batch_size)
    if getattr(args, "name", None):
        loaded.info["name"] = args.name
    return loaded


def _load_ckpt(spec: ModelSpec, args: argparse.Namespace) -> LoadedModel:
    """Our/upstream Megatron checkpoint of any layout, resharded in memory to one process."""
    from mlm_eval.scoring.megatron import TokenizerChoice, load_megatron_gpt
    from mlm_eval.scoring.parallel import launched_distributed
    from pretrain.tokenizer.factory import TokenizerConfig

    megatron = None
    if spec.tokenizer_type is not None:
        megatron = TokenizerConfig(tokenizer_type=spec.tokenizer_type, vocab_file=spec.vocab_file,
                                   merge_file=spec.merge_file,
                                   model_path=spec.tokenizer_model or spec.tokenizer_dir)  # fmt: skip
    elif spec.vocab_file is not None or spec.merge_file is not None or spec.tokenizer_model is not None:
        raise UserError(
            "--vocab-file/--merge-file/--tokenizer-model need --tokenizer-type (or use --tokenizer-dir DIR)"
        )
    tok_cfg = TokenizerChoice(megatron=megatron, directory=None if megatron else spec.tokenizer_dir,
                              force=spec.force_tokenizer)  # fmt: skip
    if spec.parallel.model_parallel_size > 1 or spec.parallel.ep > 1 or launched_distributed():
        return _load_ckpt_parallel(spec, args, tok_cfg)
    scorer, encoder, info = load_megatron_gpt(str(spec.ckpt), tokenizer_cfg=tok_cfg, batch_size=args.batch_size,
                                              device=spec.device, dtype=spec.dtype)  # fmt: skip
    if getattr(args, "name", None):
        info["name"] = args.name
    return LoadedModel(scorer=scorer, tokenizer=encoder, info=info, dtype=spec.dtype)


def _load_ckpt_parallel(spec: ModelSpec, args: argparse.Namespace, tok_cfg: Any) -> LoadedModel:
    """This rank's stage/shard of ``--ckpt`` under torchrun (TP x PP x DP)."""
    import torch.distributed as dist

    from mlm_eval.scoring.parallel import layout_name, load_parallel_gpt

    scorer, encoder, info, ps = load_parallel_gpt(str(spec.ckpt), parallel=spec.parallel, device=spec.device,
                                                  tokenizer_cfg=tok_cfg,
                                                  batch_size=args.batch_size, dtype=spec.dtype)  # fmt: skip
    if getattr(args, "name", None):
        info["name"] = args.name
    return LoadedModel(scorer=scorer, tokenizer=encoder, info=info, is_main=ps.rank == 0, layout=layout_name(ps),
                       dtype=spec.dtype, close=dist.destroy_process_group)  # fmt: skip


def load_hf_model(spec: ModelSpec, *, batch_size: int) -> LoadedModel:
    """Load ``spec.hf_model`` (offline) as an :class:`HFCausalLMScorer` and its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer  # lazy: slow import
    from transformers.utils import logging as hf_logging

    from pretrain.checkpoint.fingerprint import hf_weights_fingerprint

    model_dir = Path(str(spec.hf_model))
    tokenizer_dir = Path(spec.tokenizer_dir) if spec.tokenizer_dir else model_dir
    for flag, path in (("--hf-model", model_dir), ("--tokenizer-dir", tokenizer_dir)):
        if not path.is_dir():
            raise UserError(f"{flag} {path}: not a directory")
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise UserError(f"{tokenizer_dir}: cannot load a tokenizer ({_first_line(exc)})") from None
    refuse_bidirectional(model_dir)
    bars_were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a weight-loading bar per run is noise in an eval's output
    from safetensors import SafetensorError

    try:
        model: Any = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
        fingerprint = hf_weights_fingerprint(model.state_dict(), model.config)  # the stored weights
        model = model.to(device=spec.device, dtype=getattr(torch, spec.dtype))
    except (OSError, ValueError, RuntimeError, SafetensorError) as exc:  # SafetensorError: a truncated file
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
        "fingerprint": fingerprint,
    }
    return LoadedModel(scorer=scorer, tokenizer=tokenizer, info=info, dtype=spec.dtype)


# Encoder families whose Hugging Face "causal LM" class attends both ways unless configured as a decoder.
BIDIRECTIONAL_TYPES = ("bert", "megatron-bert", "roberta", "xlm-roberta", "camembert", "electra", "ernie",
                       "roberta-prelayernorm", "data2vec-text", "xmod", "bert-generation", "distilbert",
                       "albert", "deberta", "deberta-v2", "mpnet", "modernbert")  # fmt: skip


def refuse_bidirectional(model_dir: Path) -> None:
    """--hf-model must be a causal (left-to-right) LM: refuse encoders such as BERT up front."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise UserError(f"--hf-model {model_dir}: cannot read config.json ({_first_line(exc)})") from None
    kind = getattr(config, "model_type", "")
    if getattr(config, "is_encoder_decoder", False) or (
        kind in BIDIRECTIONAL_TYPES and not getattr(config, "is_decoder", False)
    ):
        raise UserError(
            f"--hf-model {model_dir}: a {kind} model attends in both directions; zero-shot perplexity and "
            "LAMBADA need a causal (left-to-right) language model"
        )


def check_device(device: str) -> None:
    """``--device cuda`` on a machine without CUDA: one line instead of a torch traceback."""
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {device}: CUDA is not available on this machine (use --device cpu)")
    if device.startswith("mps") and not torch.backends.mps.is_available():
        raise UserError(f"--device {device}: MPS is not available on this machine (use --device cpu)")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
