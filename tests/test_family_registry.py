"""A model family is one registration: a toy family added from a temporary module, through the
registry alone (no edit of our code), is read from Hugging Face, and written back to Hugging Face
under its own ``model_type``, computing the same function (checked with transformers)."""

from __future__ import annotations

import importlib
import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from pretrain.models import families
from tools.hf_io import export_hf, import_hf

TOY_MODULE = '''
"""A toy family: Llama's tensors and config under another Hugging Face model_type."""
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from pretrain.models.families import Family, register


class ToyLlamaConfig(LlamaConfig):
    model_type = "toyllama"


class ToyLlamaForCausalLM(LlamaForCausalLM):
    config_class = ToyLlamaConfig


AutoConfig.register("toyllama", ToyLlamaConfig, exist_ok=True)
AutoModelForCausalLM.register(ToyLlamaConfig, ToyLlamaForCausalLM, exist_ok=True)
FAMILY = register(Family(model_type="toyllama", architecture="ToyLlamaForCausalLM", converter="llama",
                         switches={"position_embedding_type": "rope", "add_qkv_bias": False, "qk_layernorm": False},
                         export_default=False))
'''


@pytest.fixture()
def toy_family(tmp_path: Path):
    (tmp_path / "toy_family_module.py").write_text(textwrap.dedent(TOY_MODULE))
    sys.path.insert(0, str(tmp_path))
    try:
        module = importlib.import_module("toy_family_module")
        yield module
    finally:
        families.unregister("toyllama")
        sys.path.remove(str(tmp_path))
        sys.modules.pop("toy_family_module", None)


def test_a_registered_family_round_trips_hf_ours_hf(toy_family, tmp_path: Path) -> None:
    assert "'toyllama'" in families.supported_model_types()
    config = toy_family.ToyLlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    source = toy_family.ToyLlamaForCausalLM(config).eval()
    source.save_pretrained(tmp_path / "hf")

    ours = import_hf(tmp_path / "hf")  # dispatched by the registry on model_type "toyllama"
    assert ours.spec.kind == "gpt" and ours.spec.cfg.query_groups == 2
    export_hf(ours, ours.spec, tmp_path / "back", family="toyllama")

    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (written["model_type"], written["architectures"]) == ("toyllama", ["ToyLlamaForCausalLM"])
    from transformers import AutoModelForCausalLM

    back = AutoModelForCausalLM.from_pretrained(tmp_path / "back", local_files_only=True).eval()
    assert type(back).__name__ == "ToyLlamaForCausalLM"
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, source(ids).logits, rtol=0, atol=0)


def test_export_keeps_the_recorded_family_else_the_default(toy_family) -> None:
    llama = {"position_embedding_type": "rope", "add_qkv_bias": False, "qk_layernorm": False}
    assert families.export_family(llama, "gpt", recorded="toyllama").model_type == "toyllama"
    assert families.export_family(llama, "gpt").model_type == "llama"  # the toy is not a default
    assert (
        families.export_family({**llama, "add_qkv_bias": True}, "gpt", recorded="toyllama").model_type
        == "qwen2"
    )


def test_unregistered_model_types_are_refused_by_name(tmp_path: Path) -> None:
    assert "toyllama" not in families.supported_model_types()
    assert families.family_of_model_type("toyllama") is None


def test_converter_interfaces_are_typed() -> None:
    """The converters' public functions name no ``Any`` (the HF config is :class:`HFConfig`), and
    the ``transformers`` configs of every registered family hold the attributes it declares."""
    import inspect
    import typing

    import transformers

    from pretrain.models.families import converter as conv

    for module in {f.module() for f in families.families()} | {conv}:
        for name, fn in inspect.getmembers(module, inspect.isfunction):
            if fn.__module__ == module.__name__ and not name.startswith("_"):
                assert "Any" not in str(inspect.signature(fn)), f"{module.__name__}.{name}"
    declared = typing.get_type_hints(conv.HFConfig)
    for family in families.families():
        config = transformers.AutoConfig.for_model(family.model_type)
        assert all(hasattr(config, attr) for attr in declared), family.model_type
