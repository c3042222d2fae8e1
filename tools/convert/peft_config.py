"""Which ``adapter_config.json`` files describe a plain LoRA adapter: ``W + (alpha / r) B A`` on
the very base weights it is loaded onto, and nothing else.

PEFT's ``LoraConfig`` carries many variants, and several change what the adapter computes without
adding a tensor, so a reader that only looked at the tensors would import them as a different
model and exit 0:

* ``alora_invocation_tokens`` (activated LoRA: the update applies only from the invocation tokens
  on; PEFT cannot merge it either);
* ``init_lora_weights`` of ``pissa``, ``olora``, ``corda``, ``loftq``, ``lora_ga``: these start
  from a base with the initial ``B A`` subtracted (or quantized), so ``B A`` is an update of that
  base, not of the one it is loaded onto (``PeftModel.from_pretrained`` redoes PiSSA's and OLoRA's
  subtraction on whatever base it is given). Such an adapter is a plain LoRA only after PEFT's
  conversion (``save_pretrained(..., path_initial_model_for_weight_conversion=...)``);
* ``use_qalora``, ``use_bdlora``, ``kasa_config``, ``monteclora_config``, ``arrow_config``,
  ``use_dora``, ``use_rslora``, ``lora_bias``, ``trainable_token_indices``, per-module patterns and
  the rest of :data:`MUST_BE_DEFAULT`.

So the reader accepts a field only if it is known to leave the function alone
(:data:`NO_EFFECT`), holds its default (:data:`MUST_BE_DEFAULT`), or, for
``init_lora_weights``, names an initialisation that only sets ``A`` and ``B``
(:data:`PLAIN_INITS`). A field it does not know (a later PEFT's variant) is refused unless it is
empty, so a new variant is never read as plain LoRA. Checked against ``peft`` 0.21's
``LoraConfig`` (``tests/test_peft_config.py`` builds each variant with ``peft`` itself).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pretrain.utils.errors import UserError

__all__ = ["MUST_BE_DEFAULT", "NO_EFFECT", "PLAIN_INITS", "check_plain_lora"]

# fields whose non-default values our LoRA cannot express (field -> the values that mean "off")
MUST_BE_DEFAULT: dict[str, tuple[object, ...]] = {
    "bias": ("none", None), "use_rslora": (False, None), "use_dora": (False, None),
    "fan_in_fan_out": (False, None), "modules_to_save": (None, []), "rank_pattern": ({}, None),
    "alpha_pattern": ({}, None), "layers_to_transform": (None, []), "layer_replication": (None, []),
    "alora_invocation_tokens": (None, []), "use_qalora": (False, None), "lora_bias": (False, None),
    "trainable_token_indices": (None, [], {}), "use_bdlora": (None, {}), "arrow_config": (None, {}),
    "kasa_config": (None, {}), "monteclora_config": (None, {}),
}  # fmt: skip

# fields that do not change a plain adapter's function on its base: metadata, what is read
# elsewhere (r, lora_alpha, target_modules/parameters: their tensors), settings of an
# initialisation or of training only, and fields that act only with one refused above
NO_EFFECT = frozenset({
    "task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
    "inference_mode", "r", "lora_alpha", "lora_dropout", "target_modules", "target_parameters",
    "exclude_modules",  # an excluded module has no tensors, which the tensor reader refuses
    "layers_pattern",  # only with layers_to_transform
    "megatron_config", "megatron_core",  # how PEFT builds Megatron parallel layers
    "loftq_config", "eva_config", "corda_config", "lora_ga_config",  # settings of an init
    "velora_config",  # a memory-saving backward for A; the forward is plain LoRA
    "qalora_group_size",  # only with use_qalora
    "runtime_config", "ensure_weight_tying",  # not saved / only with modules_to_save
})  # fmt: skip

# initialisations that only set A and B (the base weights stay as they are), besides True/False
PLAIN_INITS = frozenset({"gaussian", "eva", "orthogonal", "mica"})
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")  # prefixes (pissa_niter_4)
_EMPTY: tuple[object, ...] = (None, False, {}, [], "")


def check_plain_lora(conf: dict[str, Any], conf_path: Path) -> None:
    """Refuse (``UserError`` naming ``conf_path`` and the field) an ``adapter_config.json`` whose
    adapter is not a plain LoRA on its base (see the module docstring)."""
    for key, allowed in MUST_BE_DEFAULT.items():
        if conf.get(key) not in allowed:
            raise UserError(f"{conf_path}: {key}={conf[key]!r} is not supported (only {allowed[0]!r})")
    _check_init(conf.get("init_lora_weights", True), conf_path)
    known = NO_EFFECT | MUST_BE_DEFAULT.keys() | {"init_lora_weights"}
    for key, value in conf.items():
        if key not in known and value not in _EMPTY:
            raise UserError(
                f"{conf_path}: {key}={value!r} is a field this reader does not know (a PEFT LoRA variant?); "
                "only plain LoRA adapters are read"
            )


def _check_init(init: object, conf_path: Path) -> None:
    if isinstance(init, bool) or init is None or (isinstance(init, str) and init.lower() in PLAIN_INITS):
        return
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        raise UserError(
            f"{conf_path}: init_lora_weights={init!r} trains against a base its initialisation "
            "changed, not the one given; convert it to a plain LoRA adapter first (PEFT: save_pretrained(..., "
            "path_initial_model_for_weight_conversion=DIR_OF_THE_INITIAL_ADAPTER))"
        )
    raise UserError(f"{conf_path}: init_lora_weights={init!r} is not an initialisation this reader knows")
