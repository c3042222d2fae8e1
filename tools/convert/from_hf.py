"""``mlm-convert from-hf``: import a Hugging Face model directory as a Megatron-layout checkpoint."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from pretrain.checkpoint.work_split import SINGLE, WorkSplit
from pretrain.utils.errors import UserError
from tools.convert.writing import fingerprint_while_writing, progress_bar, tokenizer_files, write_checkpoint

if TYPE_CHECKING:
    from pathlib import Path

    from pretrain.parallel.config import ParallelConfig
    from pretrain.tokenizer.loader import ResolvedTokenizer


def _hf_tokenizer(
    hf_dir: Path, tokenizer_dir: Path | None, *, rows: int, weights_only: bool, divisible_by: int = 128,
    force: bool = False,
) -> ResolvedTokenizer | None:  # fmt: skip
    from pretrain.tokenizer.loader import ResolvedTokenizer, check_tokenizer, load_tokenizer_dir, record_of

    where, flag = (tokenizer_dir, "--tokenizer-dir") if tokenizer_dir is not None else (hf_dir, "--load")
    try:
        tok = load_tokenizer_dir(where, flag=flag)
    except UserError as exc:
        if tokenizer_dir is not None:
            raise
        if not weights_only:
            raise UserError(
                f"{exc}; pass --tokenizer-dir DIR, or --weights-only for a model without one"
            ) from None
        return None
    forced = check_tokenizer(tok, what=f"{flag} {where}", model_vocab=rows, recorded=None,
                             model_source=f"the model {hf_dir}", divisible_by=divisible_by, force=force)  # fmt: skip
    return ResolvedTokenizer(
        tokenizer=tok, source=f"{flag} {where}", record=record_of(tok), forced=tuple(forced)
    )


def _hf_model_type(hf_dir: Path) -> str | None:
    """``model_type`` of a Hugging Face directory's config.json (already read by ``open_hf``)."""
    value = json.loads((hf_dir / "config.json").read_text(encoding="utf-8")).get("model_type")
    return value if isinstance(value, str) else None


def run_from_hf(hf_dir: Path, save: Path, target: ParallelConfig, *, divisible_by: int,
                tokenizer_dir: Path | None = None, weights_only: bool = False,
                ckpt_format: str = "torch", module_names: str | None = None,
                force_tokenizer: bool = False, adapter: Path | None = None,
                adapter_as: str = "lora", split: WorkSplit = SINGLE) -> int:  # fmt: skip
    """Import ``hf_dir``; with ``adapter`` (a PEFT LoRA directory) merge it (``adapter_as``
    ``merged``) or write it as our LoRA checkpoint naming ``hf_dir`` as its base (``lora``).
    ``split`` (torchrun): this process's share of the target files."""
    from pretrain.checkpoint.legacy.writer import WriteOptions, check_output_dir
    from pretrain.checkpoint.types import Provenance
    from pretrain.utils.buffer_pool import read_only_views
    from tools.hf_io import open_hf

    check_output_dir(save, sources=(hf_dir,) if adapter is None else (hf_dir, adapter))
    # streamed: each canonical tensor is built from the memory-mapped HF files when written
    source = open_hf(hf_dir, make_vocab_size_divisible_by=divisible_by)
    if adapter is not None:
        from tools.convert.lora import keep_peft_adapter, merged_source, read_peft_adapter

        lora, tensors = read_peft_adapter(adapter, source.spec.cfg)
        if adapter_as == "lora":
            if split.parallel:
                raise UserError("--adapter-as lora writes one small adapter file: run it without torchrun")
            return keep_peft_adapter(hf_dir, source, save, lora, tensors)
        source = merged_source(source, tensors, lora)
    tok = _hf_tokenizer(hf_dir, tokenizer_dir, rows=source.spec.cfg.vocab_size, weights_only=weights_only,
                        divisible_by=divisible_by, force=force_tokenizer)  # fmt: skip
    bar = progress_bar(target.tp * target.pp * target.ep, "from-hf", shown=split.leader)
    # a fresh reader of the HF files digests them while the output is written (an adapter-merged
    # source is digested first, as before: a second one would merge the adapter twice)
    again = (
        None if adapter is not None else (lambda: open_hf(hf_dir, make_vocab_size_divisible_by=divisible_by))
    )
    with (
        bar,
        fingerprint_while_writing(
            source, again, tokenizer_files(tok), ckpt_format=ckpt_format, split=split
        ) as (fingerprint, extra),
    ):
        options = WriteOptions(
            iteration="release",
            tokenizer=None if tok is None else tok.record,
            provenance=Provenance(
                converted_from=str(hf_dir),
                source_model_type=_hf_model_type(hf_dir),
                weights_fingerprint=fingerprint,
            ),
            module_names=module_names,
        )
        # the writers only read each tensor while the HF files stay open: their mapped bytes are
        # written where they lie, not copied first (pooled_copy gives contiguous tensors back)
        with read_only_views():
            write_checkpoint(ckpt_format, source, save, target, options=options,
                             progress=lambda _name: bar.update(1), extra_files=extra, split=split)  # fmt: skip
    if not split.leader:
        return 0
    print(
        f"wrote {save} ({source.spec.kind}, tp={target.tp}, pp={target.pp}, vp={target.vp}, iteration release)"
    )
    return 0
