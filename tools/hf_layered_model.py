"""The ``transformers`` side of ``to-hf``'s verification: the exported model loaded whole, or with
its layers on the ``meta`` device and each loaded from the written safetensors just before it runs
(peak memory about one layer plus embeddings and head), with hooks that see every layer's input
and output hidden states. Used by :mod:`tools.hf_verify`."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pretrain.checkpoint.plan import ModelSpec
from pretrain.utils.errors import UserError
from tools.hf_shards import INDEX_FILE

if TYPE_CHECKING:
    from transformers.models.auto.auto_factory import _BaseAutoModelClass


class SafetensorsDir:
    """Tensors of a written Hugging Face directory, read one at a time (``model.safetensors`` or shards)."""

    def __init__(self, hf_dir: Path) -> None:
        from safetensors import safe_open

        index = hf_dir / INDEX_FILE
        if index.is_file():
            files = json.loads(index.read_text())["weight_map"]
        else:
            with safe_open(str(hf_dir / "model.safetensors"), "pt") as f:
                files = dict.fromkeys(f.keys(), "model.safetensors")
        self.dir, self.files = hf_dir, dict(files)

    def get(self, key: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self.dir / self.files[key]), "pt") as f:
            return f.get_tensor(key).float()

    def numel(self) -> int:
        from safetensors import safe_open

        total = 0
        for name in sorted(set(self.files.values())):
            with safe_open(str(self.dir / name), "pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    shape = f.get_slice(key).get_shape()
                    total += int(torch.Size(shape).numel())
        return total


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """No "Loading weights" bars or load reports from ``transformers`` while verifying."""
    from transformers.utils import logging as hf_logging

    bars, level = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def auto_class(spec: ModelSpec) -> type[_BaseAutoModelClass]:
    """The ``transformers`` auto class that loads an export of ``spec``'s kind."""
    import transformers

    return getattr(transformers, spec.model_kind.hf_auto_class)


def layers_of(model: nn.Module) -> nn.ModuleList:
    """The transformer layers of a GPT-2 / Llama-family / BERT model from ``transformers``."""
    base: Any = model.base_model
    for path in ("h", "layers", "encoder.layer"):
        obj: Any = base
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if isinstance(obj, nn.ModuleList):
            return obj
    raise RuntimeError(f"verify: cannot find the layers of {type(model).__name__}")


def layer_prefix(model: nn.Module, layers: nn.ModuleList) -> str:
    """The state-dict prefix of ``layers`` in ``model`` (``transformer.h.`` ...)."""
    for name, module in model.named_modules():
        if module is layers:
            return f"{name}."
    raise RuntimeError("verify: layers not in the model")


def output(model: nn.Module, ids: torch.Tensor, gpt: bool) -> torch.Tensor:
    out = model(input_ids=ids)
    return out.logits if gpt else out.last_hidden_state  # type: ignore[no-any-return]


@contextmanager
def layer_hooks(layers: nn.ModuleList, *, pre: Callable[[int], None] | None,
                 post: Callable[[int, torch.Tensor, torch.Tensor], None]) -> Iterator[None]:  # fmt: skip
    """``pre(i)`` before layer ``i`` runs, ``post(i, input hidden states, output hidden states)`` after."""
    handles = []
    for i, layer in enumerate(layers):
        if pre is not None:
            handles.append(layer.register_forward_pre_hook(lambda _m, _a, i=i: pre(i)))

        def after(_m: nn.Module, args: tuple[torch.Tensor, ...], kwargs: dict[str, torch.Tensor],
                  output: torch.Tensor | tuple[torch.Tensor, ...], i: int = i) -> None:  # fmt: skip
            x = args[0] if args else kwargs["hidden_states"]
            post(i, x, output[0] if isinstance(output, tuple) else output)

        handles.append(layer.register_forward_hook(after, with_kwargs=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def per_layer_model(hf_dir: Path, spec: ModelSpec) -> tuple[nn.Module, SafetensorsDir]:
    """The ``transformers`` model of ``hf_dir`` with real embeddings and head and ``meta`` layers."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(hf_dir), local_files_only=True)
    auto = auto_class(spec)
    empty = copy.deepcopy(config)
    empty.num_hidden_layers = 0
    model = auto.from_config(empty, dtype=torch.float32).eval()
    with torch.device("meta"):
        skeleton = auto.from_config(config, dtype=torch.float32)
    holder = layers_of(model)
    parent = next(m for m in model.modules() if any(c is holder for c in m.children()))
    attr = next(n for n, c in parent.named_children() if c is holder)
    setattr(parent, attr, layers_of(skeleton))
    for module in model.modules():  # the model now has the real number of layers
        if getattr(module, "config", None) is empty:
            module.config = config
    files = SafetensorsDir(hf_dir)
    load_outside_layers(model, files, layer_prefix(model, layers_of(model)))
    return model, files


def file_key(files: SafetensorsDir, key: str, model: nn.Module) -> str | None:
    """The name of ``key`` (a state-dict key of ``model``) in the files: itself, with the base
    model's prefix (a ``BertModel`` read from a ``BertForPreTraining`` export), or Mixtral's file
    name of its router (``block_sparse_moe.gate``, ``mlp.gate`` in transformers 5's module)."""
    prefixed = f"{getattr(model, 'base_model_prefix', '')}.{key}"
    mixtral = key.replace(".mlp.gate.", ".block_sparse_moe.gate.")
    return next((k for k in (key, prefixed, mixtral) if k in files.files), None)


# transformers 5's fused expert parameters <- the per-expert file tensors (Qwen/OLMoE, Mixtral names)
_FUSED_PARTS = {
    "gate_up_proj": ((".mlp.experts.{e}.", ("gate_proj", "up_proj")), (".block_sparse_moe.experts.{e}.", ("w1", "w3"))),
    "down_proj": ((".mlp.experts.{e}.", ("down_proj",)), (".block_sparse_moe.experts.{e}.", ("w2",))),
}  # fmt: skip


def fused_experts(files: SafetensorsDir, key: str) -> torch.Tensor | None:
    """``model.layers.{i}.mlp.experts.gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` stacked
    from the per-expert tensors ``save_pretrained`` writes (None when ``key`` is not one)."""
    head, _, leaf = key.rpartition(".")
    if not head.endswith(".mlp.experts") or leaf not in _FUSED_PARTS:
        return None
    layer = head[: -len(".mlp.experts")]
    for template, parts in _FUSED_PARTS[leaf]:
        stacked, e = [], 0
        while f"{layer}{template.format(e=e)}{parts[0]}.weight" in files.files:
            stacked.append(torch.cat([files.get(f"{layer}{template.format(e=e)}{p}.weight") for p in parts]))
            e += 1
        if stacked:
            return torch.stack(stacked)
    return None


def load_outside_layers(model: nn.Module, files: SafetensorsDir, layer_prefix: str) -> None:
    state = model.state_dict()
    loaded: dict[str, torch.Tensor] = {}
    for key in state:
        if key.startswith(layer_prefix):
            continue
        name = file_key(files, key, model)
        if name is not None:
            loaded[key] = files.get(name)
    model.load_state_dict(loaded, strict=False)
    ptrs = {state[k].data_ptr() for k in loaded}
    for key, t in state.items():  # anything not loaded must be tied to something that was
        if not key.startswith(layer_prefix) and key not in loaded and t.data_ptr() not in ptrs:
            raise UserError(f"to-hf verify: the export has no tensor {key}")


def layer_loader(
    model: nn.Module, files: SafetensorsDir
) -> tuple[Callable[[int], None], Callable[[int], None]]:
    layers = layers_of(model)
    prefix = layer_prefix(model, layers)

    def materialize(i: int) -> None:
        layer = layers[i].to_empty(device="cpu")
        state: dict[str, torch.Tensor] = {}
        for key, param in layer.state_dict().items():
            name = file_key(files, f"{prefix}{i}.{key}", model)
            tensor = files.get(name) if name is not None else fused_experts(files, f"{prefix}{i}.{key}")
            if tensor is None:
                raise UserError(f"to-hf verify: the export has no tensor {prefix}{i}.{key}")
            state[key], name = tensor, name or f"{prefix}{i}.{key}"
            if state[key].shape != param.shape:
                raise UserError(f"to-hf verify: {name} has shape {tuple(state[key].shape)}, "
                                f"transformers expects {tuple(param.shape)}")  # fmt: skip
        layer.load_state_dict(state, strict=True)

    def release(i: int) -> None:
        layers[i].to("meta")

    return materialize, release
