"""Hugging Face model directories <-> canonical full tensors (GPT-2 and BERT), written atomically.

This is the edge of the toolkit: the only module that reads and writes Hugging Face model files
(the engine in ``pretrain/`` imports without ``transformers``).

:func:`export_hf` writes (sharded) safetensors, streamed layer by layer, ``config.json`` and the tokenizer files of a
checkpoint (GPT with RoPE -> the Llama family, other GPT -> ``GPT2LMHeadModel``; pre-LN BERT ->
``MegatronBertForPreTraining``; post-LN BERT -> ``BertForPreTraining``; a checkpoint imported from a
bare ``BertModel`` -> ``BertModel`` again, its freshly initialised heads left out). An option the
chosen architecture cannot express is refused before anything is written (each mapping's
``unsupported``); ``check`` (``to-hf``: :mod:`tools.hf_verify`) runs on the finished directory. :func:`import_hf` reads a local HF model directory into a
:class:`~pretrain.checkpoint.types.DictSource` ready to be written at any layout; :func:`open_hf` is
the same source streamed from the memory-mapped weight files, one canonical tensor at a time.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pretrain.checkpoint.plan import ModelSpec
from pretrain.checkpoint.types import (
    ColumnPieces,
    ColumnPieceSource,
    DictSource,
    LazySource,
    RowPieces,
    RowPieceSource,
    TensorSource,
)
from pretrain.checkpoint.work_split import SINGLE, WorkSplit
from pretrain.models.families import Family, export_family, family_of_model_type, supported_model_types
from pretrain.models.families.converter import HFImport
from pretrain.tokenizer.base import Tokenizer
from pretrain.tokenizer.record import PROBE_TEXT
from pretrain.utils.errors import UserError
from tools.forked_job import ForkedJob
from tools.hf_shards import DEFAULT_MAX_SHARD_SIZE

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

    from pretrain.config import ModelConfig
    from tools.hf_plan import HFPlan

# to-hf's config and tokenizer files from a forked child (tools.forked_job); tests switch it off to
# compare with the files made in-process
FORK_HF_FILES = True
# --weights-only exports' config files made without transformers (tools.hf_config_files); tests
# switch it off to compare with transformers' own files
CONFIG_FILES_WITHOUT_TRANSFORMERS = True
# HF tensors that are whole rows of a checkpoint tensor, or one passed through, written from its
# stored row or column blocks (tools.hf_row_select); tests switch it off to compare with the joined-and-converted bytes
ROW_PIECES = True

__all__ = ["check_exportable", "export_hf", "hf_tokenizer_of", "import_hf", "open_hf", "read_hf_state"]


def hf_tokenizer_of(tok: Tokenizer) -> PreTrainedTokenizerBase:
    """A complete Hugging Face fast tokenizer equal to ``tok`` (checked on :data:`PROBE_TEXT`).

    Our ``tokenizers``-backed tokenizers (GPT-2 BPE, WordPiece) become a ``PreTrainedTokenizerFast``
    over a copy of the same Rust tokenizer, with the special tokens named (GPT-2: bos = eos = unk =
    the end-of-document token; BERT: [CLS] [SEP] [PAD] [MASK] [UNK]); a Hugging Face directory is
    loaded as itself; a SentencePiece BPE model (``Llama2Tokenizer``, ``GPTSentencePieceTokenizer``)
    becomes a ``LlamaTokenizer`` (:mod:`tools.hf_sentencepiece`). ``SentencePieceTokenizer``'s
    appended specials are refused (no exact fast equivalent).
    """
    import transformers
    from tokenizers import Tokenizer as RustTokenizer

    kind = tok.tokenizer_type
    name = {k: tok.id_to_token(v) for k, v in tok.special_ids().items() if v is not None}
    try:
        if kind == "HuggingFaceTokenizer":
            hf: Any = transformers.AutoTokenizer.from_pretrained(tok.model_path, local_files_only=True)  # type: ignore[attr-defined]
        elif kind in ("Llama2Tokenizer", "GPTSentencePieceTokenizer"):  # Llama's SentencePiece
            from tools.hf_sentencepiece import llama_tokenizer_from_sentencepiece

            hf = llama_tokenizer_from_sentencepiece(tok.model_file, add_bos=tok.adds_bos)  # type: ignore[attr-defined]
        elif tok.backend_tokenizer is not None:
            backend = RustTokenizer.from_str(tok.backend_tokenizer.to_str())
            special: dict[str, str] = {}
            if "eod" in name:
                special.update(bos_token=name["eod"], eos_token=name["eod"], unk_token=name["eod"])
            for ours, theirs in (
                ("cls", "cls_token"),
                ("sep", "sep_token"),
                ("pad", "pad_token"),
                ("mask", "mask_token"),
            ):
                if ours in name:
                    special[theirs] = name[ours]
            unk = tok.token_to_id("[UNK]")
            if unk is not None and "unk_token" not in special:
                special["unk_token"] = "[UNK]"
            hf = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False,
                                                      **special)  # fmt: skip
        else:
            raise UserError(
                f"to-hf: {kind} tokenizers are not exported to Hugging Face (no exact fast equivalent)"
            )
    except UserError:
        raise
    except Exception as exc:  # transformers raises many kinds
        raise UserError(f"cannot build a Hugging Face tokenizer from the {kind} tokenizer ({exc})") from None
    if list(hf(PROBE_TEXT, add_special_tokens=False)["input_ids"]) != tok.tokenize(PROBE_TEXT):
        raise UserError(
            f"the Hugging Face tokenizer built from the {kind} tokenizer encodes text differently"
        )
    return hf


def _special_ids(tok: Tokenizer | None) -> dict[str, int | None]:
    if tok is None:
        return {}
    bos = tok.bos
    if bos is None and tok.tokenizer_type != "HuggingFaceTokenizer":  # a HF tokenizer's None stays (Qwen2)
        bos = tok.eod  # GPT-2's convention: bos = eos = <|endoftext|>
    return {"bos_token_id": bos, "eos_token_id": tok.eod,
            "pad_token_id": tok.pad}  # fmt: skip


def export_family_of(spec: ModelSpec, recorded: str | None = None) -> Family:
    """The registered family ``spec`` exports to (``recorded``: the family its checkpoint came from,
    kept when it still holds the model; see :func:`pretrain.models.families.export_family`)."""
    return export_family(dataclasses.asdict(spec.cfg), spec.kind, recorded=recorded)


def check_exportable(spec: ModelSpec, recorded: str | None = None) -> None:
    """Raise :class:`UserError` (one line naming each option) unless the architecture ``spec`` exports
    to holds it exactly. From the config alone, so a refusal comes before any tensor is read."""
    fam = export_family_of(spec, recorded)
    fam.module().check_exportable(spec.cfg, family=fam)


def hf_state_and_config(
    full: dict[str, torch.Tensor], spec: ModelSpec, tokenizer: Tokenizer | None = None, *,
    family: str | None = None,
) -> tuple[dict[str, torch.Tensor], PretrainedConfig]:  # fmt: skip
    """The HF state dict (tied copies omitted) and ``PretrainedConfig`` of canonical tensors;
    the special-token ids are the tokenizer's (``None`` where it has none). ``family``: the HF
    ``model_type`` the checkpoint was converted from, written back when it holds the model."""
    fam = export_family_of(spec, family)
    return fam.module().export_tensors(full, spec.cfg, fresh_heads=spec.fresh_heads, family=fam), _hf_config(
        fam, spec, tokenizer
    )


def _hf_config(fam: Family, spec: ModelSpec, tokenizer: Tokenizer | None) -> PretrainedConfig:
    """``fam``'s ``PretrainedConfig`` of ``spec`` (refused first when the architecture lacks an option)."""
    from transformers import AutoConfig

    return AutoConfig.for_model(fam.model_type, **_config_kwargs(fam, spec, tokenizer))


def _config_kwargs(fam: Family, spec: ModelSpec, tokenizer: Tokenizer | None) -> dict[str, object]:
    """``fam``'s ``config.json`` keyword arguments for ``spec`` (refused first when the
    architecture lacks an option)."""
    converter = fam.module()
    converter.check_exportable(spec.cfg, family=fam)
    return converter.export_config(
        spec.cfg, fam, special_ids=_special_ids(tokenizer), fresh_heads=spec.fresh_heads
    )


def _hf_config_and_tokenizer(
    fam: Family, spec: ModelSpec, tokenizer: Tokenizer | None
) -> tuple[PretrainedConfig, PreTrainedTokenizerBase | None]:
    return _hf_config(fam, spec, tokenizer), None if tokenizer is None else hf_tokenizer_of(tokenizer)


def _tensor_access(
    tensors: Iterable[tuple[str, torch.Tensor]] | TensorSource,
) -> tuple[list[str], Callable[[str], torch.Tensor], dict[str, torch.Tensor]]:
    """(names, getter, dtype-and-shape placeholders) of a streamed source (no tensor read for its
    shape) or of in-memory pairs."""
    from pretrain.checkpoint.tensor_meta import meta_like, tensor_meta

    if isinstance(tensors, TensorSource):
        names = list(tensors.names())
        return names, tensors.tensor, {n: tensor_meta(tensors, n) for n in names}
    full = dict(tensors)
    return list(full), full.__getitem__, {n: meta_like(t) for n, t in full.items()}


def one_layer_config(cfg: ModelConfig, layer: int) -> ModelConfig | None:
    """A one-layer model whose layer is built as ``cfg``'s layer ``layer`` (its mixture-of-experts
    choice kept), for converting that layer alone; ``None`` when no such config is valid."""
    kw: dict[str, object] = {"num_layers": 1}
    if cfg.num_experts is not None:
        kw["moe_layer_freq"] = (int(cfg.is_moe_layer(layer)),)
    try:
        return dataclasses.replace(cfg, **kw)  # type: ignore[arg-type]
    except (UserError, ValueError, TypeError):
        return None


def export_hf(
    tensors: Iterable[tuple[str, torch.Tensor]] | TensorSource,
    spec: ModelSpec,
    save: Path,
    *,
    tokenizer: Tokenizer | None = None,
    family: str | None = None,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    progress: Callable[[int], Callable[[str], object]] | None = None,
    check: Callable[[Path], object] | None = None,
    split: WorkSplit = SINGLE,
) -> Path:
    """Write a HF model directory at ``save`` (atomically) from canonical ``tensors``: weights,
    ``config.json``, ``generation_config.json`` and the complete tokenizer (``tokenizer.json``,
    ``tokenizer_config.json``: transformers 5 keeps the special tokens there) with the tokenizer's
    true special ids.

    Weights are sharded safetensors as ``save_pretrained`` writes them (``max_shard_size``). A
    source with ``names()`` and ``tensor(name)`` (a checkpoint reader) is streamed one layer at a
    time (:mod:`tools.hf_shards`); an iterable of pairs is read into memory first. ``family``: see
    :func:`hf_state_and_config`. ``progress(total)`` (optional) is told the number of HF tensors and
    returns a callback called with each tensor's name once it is written. ``check(directory)``
    (optional; ``to-hf`` verifies the export with it) runs on the complete directory before it is
    renamed to ``save``: when it raises, nothing is left at ``save``. ``split``: under torchrun
    each process writes its share of the shard files, rank 0 the rest and runs ``check``."""
    from tools.hf_shards import parse_shard_size

    check_exportable(spec, family)  # refused before any work
    if tokenizer is not None and tokenizer.vocab_size > spec.cfg.vocab_size:
        raise UserError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the checkpoint only {spec.cfg.vocab_size}"
        )
    max_bytes = parse_shard_size(max_shard_size)
    names, get, metas = _tensor_access(tensors)
    fam = export_family_of(spec, family)  # resolved once: the per-layer conversion maps tensors only
    convert, layer_convert = _export_converters(fam, spec)
    hf_metas = convert(dict(metas))
    with split.directory(save) as tmp:
        # transformers' config and tokenizer files (seconds of imports that hold the GIL) are made
        # by a forked child while this process writes the weights (rank 0 alone under torchrun)
        hf_files = None
        if split.leader and not _wrote_config_files(tmp, fam, spec, tokenizer, _weights_dtype(hf_metas)):
            make = functools.partial(_write_hf_files, tmp, fam, spec, tokenizer, _weights_dtype(hf_metas))
            hf_files = ForkedJob(make, fork=FORK_HF_FILES)
        try:
            rows = tensors.row_pieces if isinstance(tensors, RowPieceSource) and ROW_PIECES else None
            columns = tensors.column_pieces if isinstance(tensors, ColumnPieceSource) and ROW_PIECES else None
            _write_weights(tmp, split, names, get, convert, layer_convert, metas, max_bytes, (rows, columns),
                           progress(len(hf_metas)) if progress is not None and split.leader else None)  # fmt: skip
            split.agree()  # every shard is written
            if hf_files is not None:
                hf_files.wait()
            if split.leader and check is not None:  # the complete directory, config files included
                check(tmp)
        finally:
            if hf_files is not None:
                hf_files.cancel()
    return save


TensorMap = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


def _export_converters(fam: Family, spec: ModelSpec) -> tuple[TensorMap, Callable[[int], TensorMap | None]]:
    """The family's canonical -> HF tensor mapping of the whole model, and of layer ``i`` alone as a
    one-layer model (``None`` where that is not the whole model's mapping). No defensive copies:
    each output is written out and dropped."""

    def convert(chunk: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return fam.module().export_tensors(
            chunk, spec.cfg, fresh_heads=spec.fresh_heads, family=fam, copy=False
        )

    @functools.cache  # one mapping object per one-layer config: alike layers share the plan's dry run
    def of_config(cfg: ModelConfig) -> TensorMap:
        return lambda chunk: fam.module().export_tensors(
            chunk, cfg, fresh_heads=spec.fresh_heads, family=fam, copy=False
        )

    def layer_convert(layer: int) -> TensorMap | None:
        cfg = one_layer_config(spec.cfg, layer)
        return None if cfg is None else of_config(cfg)

    return convert, layer_convert


def _write_weights(
    tmp: Path, split: WorkSplit, names: list[str], get: Callable[[str], torch.Tensor], convert: TensorMap,
    layer_convert: Callable[[int], TensorMap | None], metas: dict[str, torch.Tensor], max_bytes: int,
    stored: tuple[Callable[[str], RowPieces | None] | None, Callable[[str], ColumnPieces | None] | None],
    written: Callable[[str], object] | None,
) -> None:  # fmt: skip
    """The safetensors shards (and index) of the HF tensors of ``names`` into ``tmp``: this process's
    share under torchrun, else all of them; each shard's header from the tensors' dtypes and
    shapes (the plan), so every byte is written once. ``stored``: the source's row blocks and
    column blocks, so that outputs that are whole rows of one, or one passed through, are written
    from where they lie (no join, no copy)."""
    from tools.hf_plan import plan_hf_tensors, stream_hf_tensors
    from tools.hf_shards import ShardWriter

    plan = plan_hf_tensors(names, metas, convert, layer_convert)
    if split.parallel and plan is not None:
        _write_share(tmp, split, plan, max_bytes, stream=functools.partial(stream_hf_tensors, names, get, convert,
                     metas, plan, row_pieces=stored[0], column_pieces=stored[1]))  # fmt: skip
    elif split.leader:  # (no plan under torchrun: rank 0 writes every shard)
        writer = ShardWriter(tmp, max_shard_size=max_bytes, plan=None if plan is None else plan.tensors)
        for name, t in stream_hf_tensors(
            names,
            get,
            convert,
            metas,
            plan,
            row_pieces=stored[0] if plan else None,
            column_pieces=stored[1] if plan else None,
        ):
            writer.add(name, t)
            if written is not None:
                written(name)
        writer.close()


def _write_hf_files(
    tmp: Path, fam: Family, spec: ModelSpec, tokenizer: Tokenizer | None, dtype: torch.dtype | None
) -> None:
    """``config.json`` (recording ``dtype``, as ``save_pretrained`` records the model's),
    ``generation_config.json`` and the tokenizer's files into ``tmp``."""
    config, hf_tok = _hf_config_and_tokenizer(fam, spec, tokenizer)
    config.dtype = dtype
    _write_configs(tmp, config, spec, hf_tok)


def _wrote_config_files(
    tmp: Path, fam: Family, spec: ModelSpec, tokenizer: Tokenizer | None, dtype: torch.dtype | None
) -> bool:
    """Without a tokenizer, ``config.json`` and ``generation_config.json`` as transformers writes
    them, made here (:mod:`tools.hf_config_files`: no seconds of transformers imports beside the
    weights); False where only transformers can make them (or a tokenizer needs it anyway)."""
    from tools.hf_config_files import config_files

    if tokenizer is not None or not CONFIG_FILES_WITHOUT_TRANSFORMERS:
        return False
    kw = _config_kwargs(fam, spec, tokenizer)
    files = config_files(fam.model_type, kw, dtype=dtype, causal_lm=spec.model_kind.causal_lm)
    if files is None:
        return False
    for name, text in files.items():
        (tmp / name).write_text(text, encoding="utf-8")
    return True


def _write_configs(
    tmp: Path, config: PretrainedConfig, spec: ModelSpec, hf_tok: PreTrainedTokenizerBase | None
) -> None:
    """``config.json``, ``generation_config.json`` (decoders) and the tokenizer's files."""
    from transformers import GenerationConfig

    config.save_pretrained(str(tmp))
    if spec.model_kind.causal_lm:
        GenerationConfig.from_model_config(config).save_pretrained(str(tmp))
    if hf_tok is not None:
        hf_tok.save_pretrained(str(tmp))  # tokenizer.json + tokenizer_config.json


def _weights_dtype(hf_metas: dict[str, torch.Tensor]) -> torch.dtype | None:
    """The dtype ``save_pretrained`` writes into ``config.json``: its model's first floating-point
    parameter's (``get_parameter_dtype``); here the first floating-point tensor written."""
    return next((t.dtype for t in hf_metas.values() if t.dtype.is_floating_point), None)


def _write_share(
    tmp: Path, split: WorkSplit, plan: HFPlan, max_bytes: int, *,
    stream: Callable[..., Iterable[tuple[str, torch.Tensor | RowPieces | ColumnPieces]]],
) -> None:  # fmt: skip
    """This process's shard files of a split export (balanced by bytes; only their source tensors
    are read), and on rank 0 the index, made from the plan."""
    from tools.hf_shards import shard_file_names, split_shards, write_index, write_planned_shards

    shards = split_shards(plan.tensors, max_bytes)
    owned = split.mine([sum(t.nbytes for t in shard) for shard in shards])
    wanted = {t.name for shard, mine in zip(shards, owned, strict=True) if mine for t in shard}
    if wanted:
        write_planned_shards(tmp, shards, owned, stream(wanted=wanted))
    if split.leader and len(shards) > 1:
        files = shard_file_names(len(shards))
        weight_map = {t.name: files[i] for i, shard in enumerate(shards) for t in shard}
        write_index(tmp, weight_map, sum(t.nbytes for t in plan.tensors))


def _weight_files(hf_dir: Path) -> list[Path]:
    """The weight files :func:`read_hf_state` reads (safetensors, else ``pytorch_model.bin``)."""
    if (hf_dir / "model.safetensors").is_file():
        return [hf_dir / "model.safetensors"]
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        return [hf_dir / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    if (hf_dir / "pytorch_model.bin").is_file():
        return [hf_dir / "pytorch_model.bin"]
    raise UserError(f"--load {hf_dir}: no model.safetensors, safetensors index or pytorch_model.bin")


def read_hf_state(hf_dir: Path) -> dict[str, torch.Tensor]:
    """Every weight of a HF directory, memory-mapped (safetensors; a zip ``pytorch_model.bin``
    too): tensors whose pages are read from the file when touched, not copies."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file as _load_file

    def load_file(path: str) -> dict[str, torch.Tensor]:
        try:
            return _load_file(path)
        except (SafetensorError, OSError) as exc:  # truncated or not a safetensors file: one line
            raise UserError(
                f"--load {hf_dir}: cannot read {path} ({str(exc).strip() or type(exc).__name__})"
            ) from None

    files = _weight_files(hf_dir)
    if files[0].suffix == ".bin":
        try:  # a zip-format file maps; a legacy (pre-1.6) one cannot and is read whole
            return torch.load(files[0], map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:
            return torch.load(files[0], map_location="cpu", weights_only=True)
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def _hf_makers(hf_dir: Path, make_vocab_size_divisible_by: int) -> tuple[ModelSpec, HFImport]:
    """The model spec of a HF directory of a registered family and each canonical tensor's
    maker (and, where the family gives them, row blocks) over its (memory-mapped) weights;
    names, ties and the config are checked here, no tensor is converted yet."""
    from tools.hf_config_json import load_hf_config

    if not (hf_dir / "config.json").is_file():
        raise UserError(f"--load {hf_dir}: no config.json (not a Hugging Face model directory)")
    config: Any = load_hf_config(hf_dir)  # as AutoConfig reads it, without seconds of its imports
    family = family_of_model_type(config.model_type)
    if family is None:  # before reading any weights
        raise UserError(f"--load {hf_dir}: model_type {config.model_type!r} is not {supported_model_types()}")
    state = read_hf_state(hf_dir)
    imported = family.module().import_hf(
        state, config, family, make_vocab_size_divisible_by=make_vocab_size_divisible_by
    )
    spec = ModelSpec(kind=family.kind, cfg=imported.cfg, add_binary_head=imported.add_binary_head,
                     fresh_heads=imported.fresh_heads)  # fmt: skip
    return spec, imported


def import_hf(hf_dir: Path, *, make_vocab_size_divisible_by: int = 128) -> DictSource:
    """A local HF directory of a registered family -> canonical tensors (all in memory) and
    model spec. ``mlm-convert from-hf`` streams instead (:func:`open_hf`)."""
    spec, imported = _hf_makers(hf_dir, make_vocab_size_divisible_by)
    return DictSource(spec, {name: make() for name, make in imported.makers.items()})


def open_hf(hf_dir: Path, *, make_vocab_size_divisible_by: int = 128) -> LazySource:
    """A local HF directory as a streamed canonical source: its weight files stay memory-mapped
    and each canonical full tensor is built when asked for (then the pages read are given back),
    so writing a checkpoint holds one full tensor beside the file being written, not the model.
    The same tensors, in the same order, as :func:`import_hf`."""
    from pretrain.checkpoint.legacy.pages import PageReleaser, mapped_ranges

    # mappings of these files that exist already are someone else's (a transformers model of this
    # directory in this process): their written pages must not be given back (PageReleaser)
    try:
        files = _weight_files(hf_dir)
    except UserError:  # no weight files: _hf_makers says so, after its earlier checks
        files = []
    theirs = (mapped_ranges(files) or []) if files else []
    spec, imported = _hf_makers(hf_dir, make_vocab_size_divisible_by)
    pages = PageReleaser(files, skip=theirs)  # after read_hf_state mapped them
    pages.release_all()  # the tie checks' reads
    return LazySource(spec, imported.makers, after=pages.release_all, row_parts=imported.row_parts)
