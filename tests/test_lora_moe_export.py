"""LoRA exports of mixture-of-experts models: the PEFT adapter (``target_parameters`` on the fused
experts) loads with ``PeftModel.from_pretrained`` and equals the merged export; ``from-hf
--adapter`` gives our adapter back exactly; PEFT adapters we cannot hold are refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pretrain.checkpoint.fingerprint import weights_fingerprint
from pretrain.checkpoint.lora_adapter import LoraAdapter, LoraBase, read_adapter, write_adapter_checkpoint
from pretrain.checkpoint.opener import open_checkpoint
from tests.cli_helpers import one_line_error
from tests.lora_moe_fixtures import LORA, ours_from_hf, random_adapters, tiny
from tests.moe_hf_fixtures import probe
from tools.convert_cli import main

pytest.importorskip("peft")
IDS = probe(96, seed=4)


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe"])
def exported(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """An HF MoE base, its EP 2 checkpoint, a LoRA checkpoint on it, and both exports."""
    family = request.param
    root = tmp_path_factory.mktemp(f"lora_moe_export_{family}")
    hf = tiny(family)
    hf.save_pretrained(root / "hf")
    assert main(["from-hf", "--load", str(root / "hf"), "--save", str(root / "ck"), "--ep", "2",
                 "--weights-only"]) == 0  # fmt: skip
    ours, _ = ours_from_hf(family, hf)
    adapters = random_adapters(ours)
    base = LoraBase(path=str(root / "ck"), fingerprint=weights_fingerprint(open_checkpoint(root / "ck")))
    write_adapter_checkpoint(root / "lora", LoraAdapter(lora=LORA, base=base, iteration=5, tensors=adapters))
    for kind in ("merged", "adapter"):
        argv = ["to-hf", "--load", str(root / "lora"), "--save", str(root / kind), "--lora-as", kind]
        assert main([*argv, "--weights-only"]) == 0
    return {"root": root, "adapters": adapters, "family": family}


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(IDS).logits


def test_peft_adapter_loads_in_peft_and_equals_merged_export(exported) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root = exported["root"]
    conf = json.loads((root / "adapter" / "adapter_config.json").read_text())
    assert conf["r"] == 2 and conf["lora_alpha"] == 4.0 and conf["lora_dropout"] == 0.0
    assert conf["target_parameters"] == ["experts.gate_up_proj", "experts.down_proj"]
    plain = ["gate_proj", "up_proj", "down_proj"] if exported["family"] == "qwen2_moe" else []
    assert conf["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", *plain]
    names = load_file(str(root / "adapter" / "adapter_model.safetensors"))
    assert names["base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight"].shape == (6 * 2, 32)
    assert names["base_model.model.model.layers.0.mlp.experts.lora_B.weight"].shape == (32, 2 * 6)
    base = AutoModelForCausalLM.from_pretrained(root / "hf")
    base_logits = _logits(base)
    peft = PeftModel.from_pretrained(base, root / "adapter")
    merged = AutoModelForCausalLM.from_pretrained(root / "merged")
    got, want = _logits(peft), _logits(merged)
    assert (got - want).abs().max() <= 1e-5
    assert (want - base_logits).abs().max() > 1e-2  # the merge changed the model


def test_from_hf_adapter_gives_back_our_lora_exactly(exported, tmp_path: Path) -> None:
    root = exported["root"]
    argv = ["from-hf", "--load", str(root / "hf"), "--adapter", str(root / "adapter"), "--weights-only"]
    assert main([*argv, "--save", str(tmp_path / "kept")]) == 0
    kept = read_adapter(tmp_path / "kept")
    assert kept.lora == LORA and kept.base.fingerprint == read_adapter(root / "lora").base.fingerprint
    want = exported["adapters"]
    assert kept.tensors.keys() == want.keys()
    assert all(torch.equal(kept.tensors[k], want[k]) for k in want)
    assert main(["to-hf", "--load", str(tmp_path / "kept"), "--save", str(tmp_path / "again"),
                 "--lora-as", "adapter"]) == 0  # fmt: skip
    a = load_file(str(root / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "again" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_peft_adapter_trained_elsewhere_keeps_each_experts_pair(exported, tmp_path: Path) -> None:
    """PEFT's own init and random B, only the experts targeted: kept per expert, merged exactly."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = exported["root"]
    if exported["family"] != "mixtral":
        pytest.skip("one family is enough")
    pm = get_peft_model(AutoModelForCausalLM.from_pretrained(root / "hf"),
                        LoraConfig(r=3, lora_alpha=5, target_parameters=["experts.down_proj"]))  # fmt: skip
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.1)
    pm.save_pretrained(tmp_path / "peft")
    assert main(["from-hf", "--load", str(root / "hf"), "--adapter", str(tmp_path / "peft"), "--weights-only",
                 "--save", str(tmp_path / "kept")]) == 0  # fmt: skip
    kept = read_adapter(tmp_path / "kept")
    assert kept.lora.targets == ("fc2",) and kept.lora.rank == 3
    a = kept.tensors["language_model.encoder.layers.1.mlp.experts.4.dense_4h_to_h.lora_A.weight"]
    assert a.shape == (3, 24)
    assert main(["to-hf", "--load", str(tmp_path / "kept"), "--save", str(tmp_path / "merged"),
                 "--weights-only"]) == 0  # fmt: skip
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert (_logits(merged) - _logits(pm)).abs().max() <= 1e-5


def test_peft_adapters_we_cannot_hold_are_one_line(
    exported, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = exported["root"]
    if exported["family"] != "qwen2_moe":
        pytest.skip("the shared expert makes fc1 span modules and parameters")
    peft = tmp_path / "peft"
    peft.mkdir()
    conf = json.loads((root / "adapter" / "adapter_config.json").read_text())
    (peft / "adapter_model.safetensors").write_bytes(
        (root / "adapter" / "adapter_model.safetensors").read_bytes()
    )
    argv = ["from-hf", "--load", str(root / "hf"), "--adapter", str(peft), "--weights-only", "--save",
            str(tmp_path / "x")]  # fmt: skip
    cases = [
        ({"target_parameters": ["experts.gate_up_proj"]}, "without ['parameter experts.down_proj']"),
        (
            {"target_parameters": ["experts.gate_up_proj", "experts.down_proj", "experts.router"]},
            "['parameter experts.router'] are not",
        ),
        ({"use_rslora": True}, "use_rslora=True is not supported"),
    ]
    for change, needle in cases:
        (peft / "adapter_config.json").write_text(json.dumps({**conf, **change}))
        assert needle in one_line_error(main, argv, capsys)
        assert not (tmp_path / "x").exists()
