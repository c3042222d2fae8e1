"""``mlm-convert to-hf``: export a checkpoint to a Hugging Face model directory, verified before it is kept."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from pretrain.checkpoint.work_split import SINGLE, WorkSplit
from pretrain.utils.errors import UserError
from tools.convert.writing import progress_bar

if TYPE_CHECKING:
    from pathlib import Path

    from pretrain.checkpoint.types import TensorSource
    from pretrain.tokenizer.base import Tokenizer
    from tools.convert.lora import LoraAs
    from tools.convert.source import SourceOptions
    from tools.hf_verify import VerifyMode

# transformers' save_pretrained default (tools.hf_shards.DEFAULT_MAX_SHARD_SIZE; a test keeps them equal).
# Imported by the parser for --max-shard-size's default: like every command module, this one imports the
# heavy modules (torch, transformers) only inside its functions, so that ``mlm-convert --help`` stays fast.
DEFAULT_MAX_SHARD_SIZE = "5GB"


def run_to_hf(source: SourceOptions, save: Path, *, weights_only: bool = False,
              max_shard_size: str = DEFAULT_MAX_SHARD_SIZE, verify: VerifyMode | None = "auto",
              verify_tol: float = 1e-4, lora_as: LoraAs | None = None, split: WorkSplit = SINGLE) -> int:  # fmt: skip
    """Export; ``verify`` (``auto``/``full``/``per-layer``; None: skip) checks the written directory
    against the checkpoint before it is renamed to ``save`` (:mod:`tools.hf_verify`). A LoRA
    checkpoint exports merged or as a PEFT adapter (``lora_as``, :mod:`tools.convert.lora`).
    ``split`` (torchrun): this process writes its share of the shards; rank 0 verifies."""
    from pretrain.checkpoint.legacy.writer import check_output_dir
    from pretrain.checkpoint.lora_adapter import is_lora_checkpoint
    from tools.hf_io import check_exportable

    check_output_dir(save, sources=(source.load,))
    export = functools.partial(_export, save=save, max_shard_size=max_shard_size, verify=verify,
                               verify_tol=verify_tol, split=split)  # fmt: skip
    if is_lora_checkpoint(source.load, source.iteration):
        if split.parallel and lora_as == "adapter":
            raise UserError("--lora-as adapter writes one small adapter file: run it without torchrun")
        from tools.convert.lora import run_lora_to_hf

        return run_lora_to_hf(
            source, save, lora_as=lora_as or "merged", weights_only=weights_only, export=export
        )
    if lora_as is not None:
        raise UserError(
            f"--lora-as {lora_as}: --load {source.load} is not a LoRA checkpoint (no lora_adapter.pt)"
        )
    reader, given = source.open()
    meta = reader.metadata
    family = None if meta is None else meta.provenance.source_model_type  # e.g. Mistral stays Mistral
    check_exportable(reader.spec, family)  # an option the target lacks: refused before any tensor is read
    try:
        tok = source.tokenizer(reader, required=not weights_only, given=given)
    except UserError as exc:
        if "no usable tokenizer" not in str(exc):
            raise
        raise UserError(f"{exc} (or --weights-only to export the weights alone)") from None
    if not reader.info.vocab_known:
        raise UserError(
            f"--load {source.load}: the true vocabulary size is unknown; pass --vocab-size or --tokenizer-dir"
        )
    return _export(reader, None if tok is None else tok.tokenizer, family, save=save, max_shard_size=max_shard_size,
                   verify=verify, verify_tol=verify_tol, split=split)  # fmt: skip


def _export(reader: TensorSource, tokenizer: Tokenizer | None, family: str | None, *, save: Path,
            max_shard_size: str, verify: VerifyMode | None, verify_tol: float, split: WorkSplit = SINGLE) -> int:  # fmt: skip
    """The verified export of ``reader`` (a checkpoint, or a LoRA base with its adapter merged)."""
    from tools.hf_io import check_exportable, export_hf

    check_exportable(reader.spec, family)
    bars: list[Any] = []

    def start_bar(total: int) -> Any:
        bars.append(progress_bar(total, "to-hf", unit="tensor", shown=split.leader))
        return lambda _name: bars[0].update(1)

    def check(directory: Path) -> None:
        from tools.hf_verify import verify_export

        for bar in bars:
            bar.close()
        try:
            result = verify_export(
                reader, reader.spec, directory, mode=verify or "auto", tolerance=verify_tol
            )
        except UserError as exc:
            raise UserError(f"{exc}; {save} not written (--no-verify skips the check)") from None
        print(result.line())

    try:
        export_hf(reader, reader.spec, save, tokenizer=tokenizer, family=family,
                  max_shard_size=max_shard_size, progress=start_bar,
                  check=None if verify is None else check, split=split)  # fmt: skip
    finally:
        for bar in bars:
            bar.close()
    if not split.leader:
        return 0
    info = getattr(reader, "info", None)
    count = f", {info.num_parameters} parameters" if info is not None else ""
    print(f"wrote {save} ({reader.spec.kind}{count})")
    return 0
