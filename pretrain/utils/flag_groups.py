"""Command-line flags derived from typed configs: one shared set for every command.

A frozen keyword-only dataclass describes a group of flags; :func:`add_flag_group` turns it into an
``argparse`` argument group and :func:`flags_from_namespace` builds the dataclass back from the parsed
namespace, so what travels from the parser into a command is a typed object, never a loose dict.

Per field: the flag is ``--field-name`` (or ``metadata["flags"]``, e.g. Megatron's
``--tensor-model-parallel-size`` with the short alias ``--tp``), the type comes from the annotation
(``int``, ``float``, ``str``, ``Path``, ``X | None``, ``Literal[...]`` as choices, ``bool`` as a
``store_true`` switch), the help from ``metadata["help"]`` with the default appended
(``(default: 1)``), and a bad value is argparse's one-line error with exit 2.

The shared groups: :class:`TokenizerFlags`, :class:`DTypeFlags`, :class:`ParallelFlags`
(``mlm-pretrain``, ``mlm-eval``, ``mlm-finetune``, ``mlm-convert``, ``mlm-generate`` and
``mlm-layout`` use the fields they need:
``include`` picks them, ``dests`` keeps a command's existing attribute names).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import re
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from pretrain.config import DTypeName
from pretrain.tokenizer.factory import TOKENIZER_TYPES, TokenizerConfig
from pretrain.utils.errors import UserError

T = TypeVar("T")


def _help(text: str, **extra: Any) -> dict[str, Any]:
    return {"help": text, **extra}


@dataclass(frozen=True, kw_only=True)
class TokenizerFlags:
    """Which tokenizer a command uses (Megatron's flags, or a tokenizer directory)."""

    tokenizer_type: str | None = field(
        default=None, metadata=_help("which tokenizer (Megatron's names)", choices=TOKENIZER_TYPES)
    )
    vocab_file: str | None = field(
        default=None, metadata=_help("vocab.json (GPT-2 BPE) or vocab.txt (BERT WordPiece)", metavar="PATH")
    )
    merge_file: str | None = field(default=None, metadata=_help("merges.txt (GPT-2 BPE)", metavar="PATH"))
    tokenizer_model: str | None = field(
        default=None, metadata=_help("SentencePiece .model file or Hugging Face tokenizer directory")
    )
    tokenizer_dir: Path | None = field(
        default=None,
        metadata=_help(
            "a tokenizer directory to use instead of the model's own (checked against the checkpoint's)",
            metavar="DIR",
        ),
    )
    force_tokenizer: bool = field(
        default=False,
        metadata=_help(
            "use the given tokenizer even if it differs from the checkpoint's (the result says so)"
        ),
    )

    def megatron_config(self, *, default_type: str | None = None) -> TokenizerConfig | None:
        """The tokenizer Megatron's flags name (``--tokenizer-type`` and its files), or ``None``.

        Files given without ``--tokenizer-type`` take ``default_type`` (a checkpoint's
        ``args.tokenizer_type``: local copies of the files its training cluster named); with none,
        :class:`UserError`. ``--tokenizer-dir`` is the other way to name a tokenizer, not both."""
        files = [n for n in MEGATRON_TOKENIZER_FIELDS[1:] if getattr(self, n) is not None]
        kind = self.tokenizer_type or (default_type if files else None)
        if files and self.tokenizer_dir is not None:
            raise UserError(f"--tokenizer-dir and {_flag(files[0])} name two tokenizers; give one")
        if kind is None:
            if files:
                raise UserError(f"{_flag(files[0])} needs --tokenizer-type")
            return None
        if self.tokenizer_dir is not None:
            return None  # --tokenizer-type picks the type of the --tokenizer-dir files
        return TokenizerConfig(tokenizer_type=kind, vocab_file=self.vocab_file, merge_file=self.merge_file,
                               model_path=self.tokenizer_model)  # fmt: skip


# Megatron-LM's tokenizer flags (TokenizerFlags fields), type first
MEGATRON_TOKENIZER_FIELDS = ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model")


def _flag(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


@dataclass(frozen=True, kw_only=True)
class DTypeFlags:
    """The dtype of a model's weights: ``--dtype`` (evaluation) or Megatron's ``--bf16``/``--fp16``."""

    dtype: Literal["fp32", "bf16", "fp16"] = field(default="fp32", metadata=_help("model weights' dtype"))
    bf16: bool = field(default=False, metadata=_help("bfloat16 weights and compute (fp32 master weights)"))
    fp16: bool = field(default=False, metadata=_help("float16 weights and compute with loss scaling"))

    def dtype_name(self) -> DTypeName:
        """The torch dtype's name: ``--bf16``/``--fp16`` where given, else ``--dtype``."""
        if self.bf16 and self.fp16:
            raise UserError("--bf16 and --fp16 are mutually exclusive")
        if self.bf16 or self.fp16:
            return "bfloat16" if self.bf16 else "float16"
        names: dict[str, DTypeName] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
        return names[self.dtype]


@dataclass(frozen=True, kw_only=True)
class ParallelFlags:
    """The parallel layout: tensor (TP), pipeline (PP) and virtual pipeline (VP) sizes."""

    tp: int = field(
        default=1,
        metadata=_help(
            "tensor-parallel size (TP)", flags=("--tensor-model-parallel-size", "--tp"), metavar="N"
        ),
    )
    pp: int = field(
        default=1,
        metadata=_help(
            "pipeline-parallel size (PP); DP = world / (TP x PP)",
            flags=("--pipeline-model-parallel-size", "--pp"),
            metavar="N",
        ),
    )
    vp: int = field(
        default=1,
        metadata=_help("virtual pipeline chunks per stage (VP)", flags=("--vp",), metavar="N"),
    )


def _strip_optional(tp: Any) -> Any:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0] if len(rest) == 1 else str
    return tp


def _argparse_kwargs(f: dataclasses.Field[Any], annotation: Any) -> dict[str, Any]:
    tp = _strip_optional(annotation)
    default = f.default
    kwargs: dict[str, Any] = {"default": default}
    help_text = f.metadata.get("help", "")
    if tp is bool:
        kwargs["action"] = "store_true"
        kwargs["help"] = help_text
        return kwargs
    if typing.get_origin(tp) is Literal:
        kwargs["choices"] = typing.get_args(tp)
        tp = type(typing.get_args(tp)[0])
    if "choices" in f.metadata:
        kwargs["choices"] = f.metadata["choices"]
    if "metavar" in f.metadata:
        kwargs["metavar"] = f.metadata["metavar"]
    kwargs["type"] = tp
    kwargs["help"] = f"{help_text} (default: {default})" if default is not None else help_text
    return kwargs


def add_flag_group(
    parser: argparse.ArgumentParser,
    cls: type[Any],
    *,
    title: str,
    include: tuple[str, ...] | None = None,
    dests: Mapping[str, str] | None = None,
    flags: Mapping[str, tuple[str, ...]] | None = None,
    defaults: Mapping[str, Any] | None = None,
    required: tuple[str, ...] = (),
    group: Any = None,
) -> Any:
    """Add ``cls``'s fields (those in ``include``; all when ``None``) as flags to a new argument group
    titled ``title`` (or to ``group``); ``dests``/``flags``/``defaults`` override a field's attribute
    name, option strings and default; fields in ``required`` must be given. Returns the group."""
    hints = typing.get_type_hints(cls)
    target = group if group is not None else parser.add_argument_group(title)
    for f in dataclasses.fields(cls):
        if include is not None and f.name not in include:
            continue
        kwargs = _argparse_kwargs(f, hints[f.name])
        if defaults and f.name in defaults:
            kwargs["default"] = defaults[f.name]
            if "help" in kwargs and kwargs.get("action") != "store_true":
                kwargs["help"] = f"{f.metadata.get('help', '')} (default: {defaults[f.name]})"
        if f.name in required:
            kwargs["required"] = True
            kwargs["help"] = f.metadata.get("help", "")
            kwargs.pop("default", None)
        option_strings = (
            (flags or {}).get(f.name) or f.metadata.get("flags") or ("--" + f.name.replace("_", "-"),)
        )
        target.add_argument(*option_strings, dest=(dests or {}).get(f.name, f.name), **kwargs)
    return target


def flags_from_namespace(
    cls: type[T], ns: argparse.Namespace, *, dests: Mapping[str, str] | None = None
) -> T:
    """The ``cls`` instance a parsed namespace holds; fields the command did not add keep their defaults."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        dest = (dests or {}).get(f.name, f.name)
        if hasattr(ns, dest):
            values[f.name] = getattr(ns, dest)
    return cls(**values)


@contextlib.contextmanager
def renamed_flag_errors(cls: type[Any], flags: Mapping[str, tuple[str, ...]]) -> Iterator[None]:
    """Re-raise a :class:`UserError` naming ``cls``'s shared flags (``--tp``) with this command's
    names for them (``flags``, as given to :func:`add_flag_group`: ``--target-tp``).

    Checks deep in the engine (``ModelConfig.check_tensor_parallel``, ``ParallelConfig``) name the
    shared flags; a command that spells them otherwise must not send the user to a flag it lacks.
    """
    names: dict[str, str] = {}
    for f in dataclasses.fields(cls):
        if f.name in flags:
            for option in f.metadata.get("flags") or ("--" + f.name.replace("_", "-"),):
                names[option] = flags[f.name][0]
    pattern = re.compile(r"(?<![\w-])(" + "|".join(map(re.escape, names)) + r")(?![\w-])")
    try:
        yield
    except UserError as exc:
        raise UserError(pattern.sub(lambda m: names[m.group(1)], str(exc))) from None
