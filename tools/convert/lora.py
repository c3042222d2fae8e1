"""LoRA in ``mlm-convert``: export a LoRA checkpoint (merged, or as a PEFT adapter) and read PEFT adapters.

* ``to-hf --load LORA_CKPT --lora-as merged`` (the default for a LoRA checkpoint): the base the
  adapter names is opened and its fingerprint checked, the adapter merged tensor by tensor (fp32,
  cast to the base dtype), and the result goes through the normal exact export and verification.
* ``to-hf --lora-as adapter``: a PEFT adapter directory (``adapter_config.json``,
  ``adapter_model.safetensors``) with the Hugging Face module names
  (:mod:`pretrain.models.families.llama_lora`; for mixture-of-experts models
  :mod:`pretrain.models.families.moe_lora`, the routed experts as PEFT ``target_parameters``);
  checked by reading it back exactly.
* ``from-hf --load BASE --adapter PEFT_DIR``: ``--adapter-as merged`` writes BASE with the adapter
  merged; ``--adapter-as lora`` (default) writes our LoRA checkpoint (the adapter alone, naming
  BASE and its fingerprint), which ``to-hf`` exports back to the same PEFT tensors bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal

from pretrain.utils.errors import UserError

if TYPE_CHECKING:
    import torch

    from pretrain.checkpoint.lora_adapter import LoraAdapter
    from pretrain.checkpoint.types import LazySource, TensorSource
    from pretrain.config import ModelConfig
    from pretrain.models.lora import LoraConfig
    from pretrain.tokenizer.base import Tokenizer
    from tools.convert.source import SourceOptions

LoraAs = Literal["merged", "adapter"]
# the normal verified export of a (merged) source: (source, tokenizer, HF model_type) -> exit code
Exporter = Callable[["TensorSource", "Tokenizer | None", "str | None"], int]
PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


@dataclasses.dataclass(frozen=True, kw_only=True)
class OpenedBase:
    """The base weights of a LoRA checkpoint, opened: tensors, tokenizer, HF model_type."""

    source: TensorSource
    tokenizer: Tokenizer | None
    family: str | None


def open_base(adapter: LoraAdapter, source: SourceOptions, *, weights_only: bool) -> OpenedBase:
    """Open the base the adapter names (a Megatron checkpoint or a Hugging Face directory) and check
    its weights fingerprint (one line on a mismatch or a missing base)."""
    from pretrain.checkpoint.fingerprint import scheme_of, weights_fingerprint
    from pretrain.checkpoint.lora_adapter import check_base

    path = Path(adapter.base.path)
    where = f"--load {source.load}"
    if not path.exists():
        raise UserError(f"{where}: the LoRA adapter's base {path} does not exist")
    if (path / "config.json").is_file():
        opened = _open_hf_base(path, weights_only=weights_only)
    else:
        base_src = dataclasses.replace(source, load=path, iteration=None)
        reader, given = base_src.open()
        tok = base_src.tokenizer(reader, required=not weights_only, given=given)
        meta = reader.metadata
        family = None if meta is None else meta.provenance.source_model_type
        opened = OpenedBase(source=reader, tokenizer=None if tok is None else tok.tokenizer, family=family)
    check_base(
        adapter, weights_fingerprint(opened.source, scheme=scheme_of(adapter.base.fingerprint)), where=where
    )
    return opened


def _open_hf_base(path: Path, *, weights_only: bool) -> OpenedBase:
    from pretrain.tokenizer.loader import load_tokenizer_dir
    from tools.hf_io import open_hf

    model_type = json.loads((path / "config.json").read_text(encoding="utf-8")).get("model_type")
    tok = None
    try:
        tok = load_tokenizer_dir(path, flag="the LoRA base")
    except UserError:
        if not weights_only:
            raise
    return OpenedBase(
        source=open_hf(path), tokenizer=tok, family=model_type if isinstance(model_type, str) else None
    )


def merged_source(base: TensorSource, adapters: dict[str, torch.Tensor], lora: LoraConfig) -> LazySource:
    """``base`` with the adapters merged, made one tensor at a time (for the streamed export)."""
    from pretrain.checkpoint.types import LazySource
    from pretrain.models.lora import base_name, merged_tensor

    cfg = base.spec.cfg
    names = base.names()
    orphans = sorted({base_name(k) for k in adapters} - set(names))
    if orphans:
        raise UserError(f"LoRA adapter: the base has no tensor {orphans[0]}")

    def make(name: str) -> torch.Tensor:
        return merged_tensor(name, base.tensor(name), adapters, cfg, scaling=lora.scaling)

    return LazySource(base.spec, {n: functools.partial(make, n) for n in names})


def run_lora_to_hf(source: SourceOptions, save: Path, *, lora_as: LoraAs, weights_only: bool,
                   export: Exporter) -> int:  # fmt: skip
    """``to-hf`` of a LoRA checkpoint; ``export(reader, tokenizer, family)`` runs the normal
    (verified) export of a merged source."""
    from pretrain.checkpoint.lora_adapter import read_adapter

    adapter = read_adapter(source.load, source.iteration)
    base = open_base(adapter, source, weights_only=weights_only or lora_as == "adapter")
    if lora_as == "merged":
        return int(
            export(merged_source(base.source, adapter.tensors, adapter.lora), base.tokenizer, base.family)
        )
    write_peft_adapter(save, adapter, base.source.spec.cfg, base.family)
    print(f"wrote {save} (PEFT LoRA adapter r={adapter.lora.rank}, {len(adapter.tensors)} tensors)")
    return 0


def peft_config(adapter: LoraAdapter, family: str | None, cfg: ModelConfig | None = None) -> dict[str, Any]:
    """The ``adapter_config.json`` of our adapter (PEFT's LoraConfig fields); a mixture-of-experts
    ``cfg`` adds the fused expert parameters as ``target_parameters``."""
    from pretrain.models.families.llama_lora import peft_target_modules
    from pretrain.models.families.moe_lora import peft_targets

    targets = adapter.lora.targets
    if cfg is not None and cfg.num_experts:
        modules, parameters = peft_targets(cfg, targets)
    else:
        modules, parameters = peft_target_modules(targets), []
    out = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": adapter.base.path,
        "r": adapter.lora.rank, "lora_alpha": adapter.lora.alpha, "lora_dropout": adapter.lora.dropout,
        "target_modules": modules, "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "use_dora": False, "init_lora_weights": True, "inference_mode": True,
        "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {},
    }  # fmt: skip
    if parameters:
        out["target_parameters"] = parameters
    return out


def _check_llama(cfg: ModelConfig, family: str | None, what: str) -> None:
    from pretrain.models.families import llama as hf_llama

    if not cfg.swiglu or cfg.position_embedding_type != "rope" or hf_llama.unsupported(cfg):
        raise UserError(
            f"{what}: PEFT adapters are written and read for Llama-family and MoE models only ({family or 'gpt'})"
        )


def _mapping(cfg: ModelConfig, family: str | None, what: str) -> ModuleType:
    """The PEFT name mapping module of ``cfg`` (:mod:`~pretrain.models.families.llama_lora`, or
    :mod:`~pretrain.models.families.moe_lora` for a mixture-of-experts model), after checking that
    the Hugging Face family can express ``cfg`` (one line otherwise)."""
    from pretrain.models.families import llama_lora, moe, moe_lora

    if not cfg.num_experts:
        _check_llama(cfg, family, what)
        return llama_lora
    fam = family if family in moe.ARCHITECTURES else moe.family_of(cfg).model_type
    problems = moe.unsupported(cfg, fam)
    if problems:
        raise UserError(f"{what}: {moe.ARCHITECTURES[fam]} cannot express " + "; ".join(problems))
    return moe_lora


def write_peft_adapter(save: Path, adapter: LoraAdapter, cfg: ModelConfig, family: str | None) -> None:
    """Write the PEFT adapter directory atomically, after reading its tensors back exactly."""
    from safetensors.torch import save_file

    from pretrain.utils.atomic import atomic_directory

    mapping = _mapping(cfg, family, "to-hf --lora-as adapter")
    tensors = mapping.canonical_to_peft(adapter.tensors, cfg, adapter.lora.targets)
    back = mapping.peft_to_canonical(tensors, cfg, adapter.lora.targets, where="to-hf --lora-as adapter")
    if back.keys() != adapter.tensors.keys() or any(not back[k].equal(v) for k, v in adapter.tensors.items()):
        raise UserError(
            f"to-hf --lora-as adapter: the PEFT tensors do not read back exactly; {save} not written"
        )
    with atomic_directory(save) as tmp:
        save_file(tensors, str(tmp / PEFT_WEIGHTS), metadata={"format": "pt"})
        (tmp / PEFT_CONFIG).write_text(
            json.dumps(peft_config(adapter, family, cfg), indent=2) + "\n", encoding="utf-8"
        )


def read_peft_adapter(adapter_dir: Path, cfg: ModelConfig) -> tuple[LoraConfig, dict[str, torch.Tensor]]:
    """A PEFT LoRA adapter directory -> (our settings, our full canonical adapter tensors), exact.
    ``UserError`` naming the file and field on anything our LoRA cannot hold."""
    from safetensors.torch import load_file

    from pretrain.models.families.llama_lora import targets_of_peft_modules
    from pretrain.models.families.moe_lora import targets_of_peft
    from pretrain.models.lora import LoraConfig
    from tools.convert.peft_config import check_plain_lora

    where = f"--adapter {adapter_dir}"
    conf_path, weights = adapter_dir / PEFT_CONFIG, adapter_dir / PEFT_WEIGHTS
    for p in (conf_path, weights):
        if not p.is_file():
            raise UserError(f"{where}: no {p.name}")
    try:
        conf = json.loads(conf_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"{conf_path}: not JSON ({exc})") from None
    if not isinstance(conf, dict):
        raise UserError(f"{conf_path}: not a JSON object")
    if conf.get("peft_type") != "LORA":
        raise UserError(f"{conf_path}: peft_type {conf.get('peft_type')!r}, only LORA is read")
    check_plain_lora(conf, conf_path)
    modules = conf.get("target_modules")
    if not isinstance(modules, list):
        raise UserError(f"{conf_path}: target_modules must be a list of module names, got {modules!r}")
    parameters = conf.get("target_parameters") or []
    if not isinstance(parameters, list):
        raise UserError(
            f"{conf_path}: target_parameters must be a list of parameter names, got {parameters!r}"
        )
    mapping = _mapping(cfg, None, where)
    if cfg.num_experts:
        targets = targets_of_peft(cfg, modules, parameters, where=str(conf_path))
    elif parameters:
        raise UserError(f"{conf_path}: target_parameters {parameters} on a model without experts is not read")
    else:
        targets = targets_of_peft_modules(modules, where=str(conf_path))
    lora = LoraConfig(rank=int(conf["r"]), alpha=float(conf["lora_alpha"]),
                      dropout=float(conf.get("lora_dropout") or 0.0), targets=targets)  # fmt: skip
    tensors = mapping.peft_to_canonical(load_file(str(weights)), cfg, targets, where=str(weights))
    check_adapter_shapes(tensors, cfg, lora, where=str(weights))
    return lora, tensors


def check_adapter_shapes(
    tensors: dict[str, torch.Tensor], cfg: ModelConfig, lora: LoraConfig, *, where: str
) -> None:
    """Every adapter tensor has the shape its target and rank give (``UserError`` naming it)."""
    from pretrain.models.lora import LORA_A, adapter_shapes, expert_kind, target_of

    for name, t in tensors.items():
        target = target_of(name)
        if target is None:
            raise UserError(f"{where}: tensor {name} adapts no LoRA target")
        a_shape, b_shape = adapter_shapes(target, cfg, lora.rank, kind=expert_kind(name))
        want = a_shape if f".{LORA_A}." in name else b_shape
        if tuple(t.shape) != want:
            raise UserError(
                f"{where}: tensor {name} has shape {tuple(t.shape)}, expected {want} (r={lora.rank})"
            )


def keep_peft_adapter(hf_dir: Path, base: TensorSource, save: Path, lora: LoraConfig,
                      tensors: dict[str, torch.Tensor]) -> int:  # fmt: skip
    """``from-hf --adapter-as lora``: our LoRA checkpoint at ``save`` (iteration ``release``) naming
    ``hf_dir`` and its weights fingerprint as the base."""
    from pretrain.checkpoint.fingerprint import short_fingerprint, weights_fingerprint
    from pretrain.checkpoint.lora_adapter import LoraAdapter, LoraBase, write_adapter_checkpoint

    fingerprint = weights_fingerprint(base)
    adapter = LoraAdapter(lora=lora, base=LoraBase(path=str(hf_dir.resolve()), fingerprint=fingerprint),
                          iteration="release", tensors=tensors)  # fmt: skip
    write_adapter_checkpoint(save, adapter)
    print(f"wrote {save} (LoRA adapter r={lora.rank} of {hf_dir}, base {short_fingerprint(fingerprint)})")
    return 0
