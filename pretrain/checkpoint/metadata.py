"""The ``args`` of a checkpoint: an ``argparse.Namespace`` with Megatron-LM's field names, and our
typed :class:`~pretrain.checkpoint.types.CheckpointMetadata` nested inside as plain data.

Upstream tools read ``args`` by attribute (``args.num_layers``, ``args.padded_vocab_size``,
``args.bias_gelu_fusion``, ...), so :func:`to_args` writes every field Megatron-LM has for what our
models are; our own record goes under ``args.mlm_toolkit`` (dicts, lists, strings and numbers only).
:func:`read_metadata` is the one reader of that record (both the current and the older
``mlm_toolkit`` dict form of our earlier checkpoints); nothing else reads ``args["mlm_toolkit"]``.
Files load with ``torch.load(weights_only=True)`` under :data:`SAFE_GLOBALS`.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from pretrain.checkpoint.types import (
    METADATA_SCHEMA,
    CheckpointMetadata,
    FinetuneRecord,
    Provenance,
    TokenizerRecord,
)
from pretrain.config import ModelConfig
from pretrain.model_options import args_from_config
from pretrain.models.kinds import is_kind, kind_of, kind_of_config
from pretrain.parallel.config import ParallelConfig
from pretrain.tensor_parallel.vocab import padded_vocab_size
from pretrain.utils.errors import UserError

OURS = "mlm_toolkit"  # the Namespace field holding our record
SAFE_GLOBALS: list[Any] = [argparse.Namespace]  # what torch.load(weights_only=True) must allow
# A Namespace is an attribute bag: its values stay under weights_only's own restrictions, so
# allowing it process-wide lets any torch.load(weights_only=True) read our files.
torch.serialization.add_safe_globals(SAFE_GLOBALS)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_TOKENIZER_FILE_ARGS = {"vocab.json": "vocab_file", "vocab.txt": "vocab_file", "merges.txt": "merge_file"}


def as_mapping(args: object) -> Mapping[str, Any]:
    """``args`` of any checkpoint as a mapping: a Namespace's fields, a dict, or ``{}``."""
    if isinstance(args, argparse.Namespace):
        return vars(args)
    return args if isinstance(args, Mapping) else {}


def _megatron_fields(meta: CheckpointMetadata) -> dict[str, Any]:
    """Megatron-LM's names for everything our model, layout and tokenizer are."""
    cfg, par, tok = meta.model, meta.parallel, meta.tokenizer
    padded = padded_vocab_size(cfg.vocab_size, tp=par.tp, divisible_by=cfg.make_vocab_size_divisible_by)
    files: dict[str, str | None] = {arg: None for arg in ("vocab_file", "merge_file", "tokenizer_model")}
    for name in tok.files if tok else ():
        arg = _TOKENIZER_FILE_ARGS.get(name, "tokenizer_model" if name.endswith(".model") else None)
        if arg is not None:
            files[arg] = f"tokenizer/{name}"  # relative to the checkpoint root
    return {
        **args_from_config(cfg, mcore=meta.module_names == "mcore"),  # every model option
        "seq_length": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "padded_vocab_size": padded,
        "tokenizer_type": tok.tokenizer_type if tok else None,
        **files,
        "tensor_model_parallel_size": par.tp,
        "pipeline_model_parallel_size": par.pp,
        "virtual_pipeline_model_parallel_size": par.vp if par.vp > 1 else None,
        "decoder_first_pipeline_num_layers": par.num_layers_in_first_stage,
        "decoder_last_pipeline_num_layers": par.num_layers_in_last_stage,
        "expert_model_parallel_size": par.ep,
        "expert_tensor_parallel_size": par.expert_tp,
        "sequence_parallel": False,
        "apply_residual_connection_post_layernorm": False,
        "apply_query_key_layer_scaling": False,
        "attention_softmax_in_fp32": True,
        "fp16": cfg.params_dtype == "float16",
        "bf16": cfg.params_dtype == "bfloat16",
        "params_dtype": _DTYPES[cfg.params_dtype],
        "bert_binary_head": meta.add_binary_head,
        "transformer_impl": "local",
        "use_mcore_models": meta.module_names == "mcore",
        "use_legacy_models": meta.module_names != "mcore",
        "ckpt_format": "torch",
        "data_parallel_random_init": False,
    }


def to_args(meta: CheckpointMetadata, *, iteration: int | str | None = None) -> argparse.Namespace:
    """The ``args`` Namespace of a checkpoint at ``iteration`` (provenance updated to it)."""
    prov = meta.provenance
    if iteration is not None:
        consumed = prov.consumed_samples
        if isinstance(iteration, int) and prov.global_batch_size:
            consumed = iteration * prov.global_batch_size
        prov = dataclasses.replace(prov, iteration=iteration, consumed_samples=consumed)
        meta = dataclasses.replace(meta, provenance=prov)
    fields = _megatron_fields(meta)
    fields.update(
        iteration=prov.iteration if isinstance(prov.iteration, int) else 0,
        consumed_train_samples=prov.consumed_samples or 0,
        consumed_valid_samples=0,
        skipped_train_samples=0,
        global_batch_size=prov.global_batch_size,
    )
    fields[OURS] = metadata_to_plain(meta)
    return argparse.Namespace(**fields)


def metadata_to_plain(meta: CheckpointMetadata) -> dict[str, Any]:
    """The record as plain data (what ``args.mlm_toolkit`` holds)."""
    out = dataclasses.asdict(meta)
    out["schema"] = METADATA_SCHEMA
    return _listify(out)


def _listify(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _listify(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_listify(v) for v in value]
    return value


def _known(cls: type, data: Mapping[str, Any], *, tuples: tuple[str, ...] = ()) -> Any:
    """``cls(**data)`` keeping only the fields ``cls`` has (records of newer versions load too)."""
    names = {f.name for f in dataclasses.fields(cls)}
    kw = {k: (tuple(v) if k in tuples and v is not None else v) for k, v in data.items() if k in names}
    return cls(**kw)


def _model_config(data: Mapping[str, Any], source: str) -> ModelConfig:
    unknown = sorted(set(data) - {f.name for f in dataclasses.fields(ModelConfig)})
    if unknown:
        raise UserError(
            f"{source}: the checkpoint's model config has fields this version does not know: "
            f"{', '.join(unknown)} (written by a newer mlm-toolkit?)"
        )
    try:
        return ModelConfig(**data)
    except TypeError as exc:
        raise UserError(f"{source}: the checkpoint's model config is incomplete ({exc})") from None


def _legacy_tokenizer(tok: Mapping[str, Any]) -> TokenizerRecord | None:
    """The tokenizer of our earlier checkpoints: ``TokenizerConfig.to_dict()`` (absolute paths)."""
    kind = tok.get("tokenizer_type")
    if not isinstance(kind, str):
        return None
    paths = tuple(str(tok[k]) for k in ("vocab_file", "merge_file", "model_path") if tok.get(k))
    return TokenizerRecord(tokenizer_type=kind, files=paths)


def _from_plain(ours: Mapping[str, Any], args: Mapping[str, Any], source: str) -> CheckpointMetadata:
    model = _model_config(ours.get("model") or {}, source)
    par = ours.get("parallel")
    parallel = _known(ParallelConfig, par) if isinstance(par, Mapping) else _upstream_parallel(args)
    tok = ours.get("tokenizer")
    if isinstance(tok, Mapping) and ours.get("schema") == METADATA_SCHEMA:
        tokenizer = _known(TokenizerRecord, tok, tuples=("files", "probe_ids"))
    else:
        tokenizer = _legacy_tokenizer(tok) if isinstance(tok, Mapping) else None
    prov = ours.get("provenance")
    if isinstance(prov, Mapping):
        provenance = _known(Provenance, prov, tuples=("argv",))
    else:  # the earlier form: loose keys
        provenance = Provenance(
            iteration=args.get("iteration") if isinstance(args.get("iteration"), int) else None,
            converted_from=ours.get("converted_from"),
            resharded_from=ours.get("resharded_from"),
            argv=tuple(ours.get("argv") or ()),
        )
    ft = ours.get("finetune")
    finetune = _known(FinetuneRecord, ft) if isinstance(ft, Mapping) and ft.get("task") else None
    recorded, megatron = ours.get("kind"), args.get("model_type")
    if recorded is not None:  # recorded by us: a kind this version lacks is an error, not a guess
        kind = kind_of(recorded, where=f"{source}: {OURS}.kind").name
    else:  # earlier records: Megatron's model_type, else what the config says
        kind = megatron if isinstance(megatron, str) and is_kind(megatron) else kind_of_config(model).name
    return CheckpointMetadata(
        kind=kind,
        model=model,
        parallel=parallel,
        tokenizer=tokenizer,
        provenance=provenance,
        add_binary_head=bool(ours.get("add_binary_head", False)),
        fresh_heads=tuple(ours.get("fresh_heads") or ()),
        finetune=finetune,
        module_names=str(ours.get("module_names") or "legacy"),
    )


def _upstream_parallel(args: Mapping[str, Any]) -> ParallelConfig:
    tp, etp = int(args.get("tensor_model_parallel_size") or 1), args.get("expert_tensor_parallel_size")
    return ParallelConfig(
        tp=tp,
        pp=int(args.get("pipeline_model_parallel_size") or 1),
        vp=int(args.get("virtual_pipeline_model_parallel_size") or 1),
        ep=int(args.get("expert_model_parallel_size") or 1),
        etp=int(etp) if etp and int(etp) != tp else None,  # Megatron records ETP = TP by default
    )


def read_metadata(args: object, *, source: str = "checkpoint") -> CheckpointMetadata | None:
    """Our record from a checkpoint's ``args`` (Namespace or dict); ``None`` for upstream files."""
    mapping = as_mapping(args)
    ours = mapping.get(OURS)
    if not isinstance(ours, Mapping):
        return None
    if not isinstance(ours.get("model"), Mapping):
        raise UserError(f"{source}: args.{OURS} has no model entry (damaged checkpoint metadata)")
    meta = _from_plain(ours, mapping, source)
    _check_expert_args(meta, mapping, source)
    return meta


_EXPERT_ARGS = ("num_experts", "moe_router_topk")


def _check_expert_args(meta: CheckpointMetadata, args: Mapping[str, Any], source: str) -> None:
    """Megatron-LM builds its model from ``args``, we from our record: an expert count or top-k on
    which the two disagree (an edited ``args``) is refused rather than read one way or the other."""
    if meta.model.num_experts is None and not args.get("num_experts"):
        return
    recorded = args_from_config(meta.model, mcore=meta.module_names == "mcore")
    for key in _EXPERT_ARGS:
        if key in args and args[key] != recorded[key]:
            raise UserError(
                f"{source}: args.{key} is {args[key]} but the model record (args.{OURS}.model) says "
                f"{recorded[key]}; they must agree"
            )


def require_metadata(args: object, *, source: str) -> CheckpointMetadata:
    """:func:`read_metadata`, refusing checkpoints without our record with one line."""
    meta = read_metadata(args, source=source)
    if meta is None:
        raise UserError(f"{source}: args has no {OURS} record (not written by mlm-toolkit)")
    return meta


def parallel_of(args: object) -> ParallelConfig:
    """The layout a checkpoint was saved with (our record, else Megatron's fields)."""
    meta = read_metadata(args)
    return meta.parallel if meta is not None else _upstream_parallel(as_mapping(args))
