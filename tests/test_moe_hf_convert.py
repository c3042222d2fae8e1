"""Hugging Face mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): our model equals
transformers' logit for logit; HF -> ours (tp2 pp2) -> reshard -> HF is exact and is what
``save_pretrained`` writes; both expert layouts are read; options a family cannot hold are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pretrain.checkpoint.plan import ModelSpec
from pretrain.utils.errors import UserError
from tests.moe_hf_fixtures import FAMILIES, hf_model, import_state, our_model, probe, save_hf
from tools.convert_cli import main
from tools.hf_io import check_exportable, import_hf

pytest.importorskip("transformers")
ARCH = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
        "olmoe": "OlmoeForCausalLM"}  # fmt: skip


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_transformers(family: str) -> None:
    hf = hf_model(family)
    cfg, full = import_state(family, hf)
    ours, ids = our_model(cfg, full), probe(cfg.vocab_size)
    with torch.no_grad():
        want = hf(ids).logits
        got = ours.full_logits(ours(ids))
        experts = hf.model.layers[0].mlp.gate(hf.model.embed_tokens(ids).reshape(-1, cfg.hidden_size))[2]
    assert len({tuple(sorted(r)) for r in experts.tolist()}) > 4  # the routes differ between tokens
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)


def test_router_and_layer_options_are_read() -> None:
    assert not import_state("mixtral", hf_model("mixtral"))[0].moe_router_pre_softmax  # renormalised
    q2 = import_state("qwen2_moe", hf_model("qwen2_moe"))[0]
    assert q2.moe_router_pre_softmax and q2.moe_layer_freq == (1, 0, 1, 1) and q2.moe_shared_expert_gate
    assert q2.add_qkv_bias and q2.moe_shared_expert_intermediate_size == 20 and q2.ffn_hidden_size == 40
    q3 = import_state("qwen3_moe", hf_model("qwen3_moe"))[0]
    assert not q3.moe_router_pre_softmax and q3.qk_layernorm and q3.kv_channels == 12
    ol = import_state("olmoe", hf_model("olmoe"))[0]
    assert ol.qk_layernorm_full_width and not ol.qk_layernorm and ol.moe_router_pre_softmax
    step = import_state("qwen2_moe", hf_model("qwen2_moe", decoder_sparse_step=2, mlp_only_layers=[]))[0]
    assert step.moe_layer_freq == (0, 1, 0, 1)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_tp2_pp2_is_exact_and_loads_cleanly(tmp_path: Path, family: str) -> None:
    from transformers import AutoModelForCausalLM

    save_hf(family, tmp_path / "hf")
    steps = [
        ["from-hf", "--load", "hf", "--save", "ck", "--tp", "2", "--pp", "2", "--weights-only"],
        [
            "reshard",
            "--load",
            "ck",
            "--save",
            "ck1",
            "--target-tp",
            "1",
            "--target-pp",
            "2",
            "--target-vp",
            "2",
        ],
        ["to-hf", "--load", "ck1", "--save", "out", "--weights-only", "--verify"],
    ]
    for argv in steps:
        assert main([str(tmp_path / a) if a in ("hf", "ck", "ck1", "out") else a for a in argv]) == 0, argv
    before, after = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("hf", "out"))
    assert set(after) == set(before)
    for name, t in before.items():
        assert torch.equal(after[name], t), name
    written, original = (json.loads((tmp_path / d / "config.json").read_text()) for d in ("out", "hf"))
    assert written["architectures"] == [ARCH[family]]
    ignore = {"bos_token_id", "eos_token_id", "pad_token_id"}  # --weights-only: no tokenizer
    assert {k: v for k, v in written.items() if k not in ignore} == {
        k: v for k, v in original.items() if k not in ignore
    }
    _, info = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]


def _save_fused(family: str, directory: Path, **overrides: object) -> None:
    """The model as transformers 5 holds it in memory (``mlp.experts.gate_up_proj`` ...)."""
    hf = hf_model(family, **overrides)
    directory.mkdir()
    hf.config.save_pretrained(str(directory))
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_layout_reads_as_the_per_expert_layout(tmp_path: Path, family: str) -> None:
    save_hf(family, tmp_path / "per_expert")
    _save_fused(family, tmp_path / "fused")
    assert any(
        k.endswith("experts.gate_up_proj") for k in load_file(str(tmp_path / "fused" / "model.safetensors"))
    )
    a, b = import_hf(tmp_path / "per_expert"), import_hf(tmp_path / "fused")
    assert a.spec.cfg == b.spec.cfg and set(a.names()) == set(b.names())
    for name in a.names():
        assert torch.equal(a.tensor(name), b.tensor(name)), name


def _spec(family: str, **changes: object) -> ModelSpec:
    import dataclasses

    cfg = import_state(family, hf_model(family))[0]
    return ModelSpec(kind="gpt", cfg=dataclasses.replace(cfg, **changes))


@pytest.mark.parametrize(
    ("family", "changes", "named"),
    [
        ("mixtral", {"moe_router_topk_scaling_factor": 2.0}, "moe_router_topk_scaling_factor=2.0"),
        ("mixtral", {"moe_router_score_function": "sigmoid"}, "moe_router_score_function=sigmoid"),
        ("mixtral", {"moe_shared_expert_intermediate_size": 16}, "moe_shared_expert_intermediate_size=16"),
        ("mixtral", {"moe_layer_freq": (1, 0, 1, 1)}, "every layer"),
        ("olmoe", {"moe_layer_freq": 2}, "every layer"),
        ("qwen3_moe", {"moe_shared_expert_intermediate_size": 16}, "has no shared expert"),
        ("qwen2_moe", {"moe_shared_expert_gate": False}, "moe_shared_expert_gate=False"),
    ],
)
def test_options_the_family_lacks_are_refused(family: str, changes: dict[str, object], named: str) -> None:
    with pytest.raises(UserError, match=named) as exc:
        check_exportable(_spec(family, **changes), recorded=family)
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("family", FAMILIES)
def test_layered_option_groups_round_trip(family: str) -> None:
    """Each MoE family's keys are its own option group over llama's: written and read back they
    give the same fields, and llama's refusal of experts is replaced by the family's key."""
    from types import SimpleNamespace

    from pretrain import model_option_hf as mo_hf

    cfg = import_state(family, hf_model(family))[0]
    groups = ("llama", family)
    written = mo_hf.hf_kwargs(cfg, groups)
    assert written["num_experts_per_tok"] == 2 and "num_experts" not in mo_hf.hf_unsupported(
        cfg, groups, family
    )
    read = mo_hf.config_kwargs_from_hf(SimpleNamespace(**written), groups)
    for field, value in read.items():
        if field != "ffn_hidden_size":  # Mixtral/OLMoE: intermediate_size is the expert width
            assert value == getattr(cfg, field), field
    assert mo_hf.hf_unsupported(cfg, "llama", "Llama")  # the dense group refuses the experts
