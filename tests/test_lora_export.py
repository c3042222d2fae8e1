"""LoRA exports: the PEFT adapter loads in ``peft`` and equals the merged export; ``from-hf
--adapter`` gives our adapter back exactly; a LoRA checkpoint on other base weights is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pretrain.checkpoint.fingerprint import weights_fingerprint
from pretrain.checkpoint.lora_adapter import LoraAdapter, LoraBase, read_adapter, write_adapter_checkpoint
from pretrain.checkpoint.opener import open_checkpoint
from pretrain.utils.errors import UserError
from tests.cli_helpers import one_line_error
from tests.lora_fixtures import LORA, ours_from_hf, randomise_adapters, tiny_hf
from tools.convert_cli import main

pytest.importorskip("peft")
IDS = torch.randint(0, 301, (2, 20), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """An HF base, its tp2 checkpoint, a LoRA checkpoint on it, and both exports."""
    root = tmp_path_factory.mktemp("lora_export")
    hf = tiny_hf("llama3")
    hf.save_pretrained(root / "hf")
    assert main(["from-hf", "--load", str(root / "hf"), "--save", str(root / "ck"), "--tp", "2",
                 "--weights-only"]) == 0  # fmt: skip
    adapters = randomise_adapters(ours_from_hf(hf))
    base = LoraBase(path=str(root / "ck"), fingerprint=weights_fingerprint(open_checkpoint(root / "ck")))
    write_adapter_checkpoint(root / "lora", LoraAdapter(lora=LORA, base=base, iteration=5, tensors=adapters))
    for kind in ("merged", "adapter"):
        argv = ["to-hf", "--load", str(root / "lora"), "--save", str(root / kind), "--lora-as", kind]
        assert main([*argv, "--weights-only"]) == 0
    return {"root": root, "adapters": adapters}


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(IDS).logits


def test_peft_adapter_loads_in_peft_and_equals_merged_export(exported) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root = exported["root"]
    conf = json.loads((root / "adapter" / "adapter_config.json").read_text())
    assert conf["peft_type"] == "LORA" and conf["r"] == 4 and conf["lora_alpha"] == 8.0
    assert sorted(conf["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    names = load_file(str(root / "adapter" / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in names
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
    assert kept.lora == LORA and kept.base.path == str((root / "hf").resolve())
    assert kept.base.fingerprint == read_adapter(root / "lora").base.fingerprint  # same weights, any format
    want = exported["adapters"]
    assert kept.tensors.keys() == want.keys()
    assert all(torch.equal(kept.tensors[k], want[k]) for k in want)
    # kept -> PEFT again: the same bytes of tensors
    assert main(["to-hf", "--load", str(tmp_path / "kept"), "--save", str(tmp_path / "again"),
                 "--lora-as", "adapter"]) == 0  # fmt: skip
    a = load_file(str(root / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "again" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # merged on import equals the merged export
    assert main([*argv, "--adapter-as", "merged", "--save", str(tmp_path / "mck")]) == 0
    assert main(["to-hf", "--load", str(tmp_path / "mck"), "--save", str(tmp_path / "mhf"),
                 "--weights-only"]) == 0  # fmt: skip
    m1, m2 = (
        load_file(str(root / "merged" / "model.safetensors")),
        load_file(str(tmp_path / "mhf" / "model.safetensors")),
    )
    assert m1.keys() == m2.keys() and all(torch.equal(m1[k], m2[k]) for k in m1)


def test_peft_adapter_trained_elsewhere_keeps_its_per_module_a(exported, tmp_path: Path) -> None:
    """PEFT's own init gives q/k/v different A: kept as the blocks of our fused A, exactly."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = exported["root"]
    pm = get_peft_model(AutoModelForCausalLM.from_pretrained(root / "hf"),
                        LoraConfig(r=2, lora_alpha=3, target_modules=["q_proj", "k_proj", "v_proj", "down_proj"]))  # fmt: skip
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_()
    pm.save_pretrained(tmp_path / "peft")
    assert main(["from-hf", "--load", str(root / "hf"), "--adapter", str(tmp_path / "peft"), "--weights-only",
                 "--save", str(tmp_path / "kept")]) == 0  # fmt: skip
    kept = read_adapter(tmp_path / "kept")
    assert kept.lora.targets == ("qkv", "fc2") and kept.lora.rank == 2
    a = kept.tensors["language_model.encoder.layers.1.self_attention.query_key_value.lora_A.weight"]
    assert a.shape == (6, 48) and not torch.equal(a[:2], a[2:4])
    assert main(["to-hf", "--load", str(tmp_path / "kept"), "--save", str(tmp_path / "merged"),
                 "--weights-only"]) == 0  # fmt: skip
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert (_logits(merged) - _logits(pm)).abs().max() <= 1e-5


def test_refusals_are_one_line(exported, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = exported["root"]
    other = tiny_hf("llama3", seed=3)
    other.save_pretrained(tmp_path / "other")
    assert (
        main(
            ["from-hf", "--load", str(tmp_path / "other"), "--save", str(tmp_path / "ck2"), "--weights-only"]
        )
        == 0
    )
    adapter = read_adapter(root / "lora")
    moved = LoraAdapter(lora=adapter.lora, base=LoraBase(path=str(tmp_path / "ck2"), fingerprint=adapter.base.fingerprint),
                        iteration=1, tensors=adapter.tensors)  # fmt: skip
    write_adapter_checkpoint(tmp_path / "wrong", moved)
    capsys.readouterr()
    err = one_line_error(main, ["to-hf", "--load", str(tmp_path / "wrong"), "--save", str(tmp_path / "x"),
                                "--weights-only"], capsys)  # fmt: skip
    assert "are not the ones this LoRA adapter was trained on" in err and not (tmp_path / "x").exists()
    err = one_line_error(main, ["to-hf", "--load", str(root / "ck"), "--save", str(tmp_path / "y"),
                                "--lora-as", "adapter", "--weights-only"], capsys)  # fmt: skip
    assert "is not a LoRA checkpoint" in err
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "use_dora": True}))
    (bad / "adapter_model.safetensors").write_bytes(b"")
    err = one_line_error(main, ["from-hf", "--load", str(root / "hf"), "--adapter", str(bad), "--save",
                                str(tmp_path / "z"), "--weights-only"], capsys)  # fmt: skip
    assert "adapter_config.json: use_dora=True is not supported" in err
    err = one_line_error(main, ["from-hf", "--load", str(root / "hf"), "--adapter", str(tmp_path / "none"),
                                "--save", str(tmp_path / "z"), "--weights-only"], capsys)  # fmt: skip
    assert "--adapter" in err and "not a directory" in err


def test_open_checkpoint_reads_a_lora_checkpoint_as_its_merged_model(exported, tmp_path: Path) -> None:
    """mlm-eval/mlm-generate/reshard open checkpoints through open_checkpoint: a LoRA checkpoint
    reads as its base with the adapter merged, after the base's fingerprint is checked."""
    from pretrain.models.lora import merged_state

    root = exported["root"]
    base = open_checkpoint(root / "ck")
    reader = open_checkpoint(root / "lora")
    want = merged_state({n: base.tensor(n) for n in base.names()}, exported["adapters"], base.spec.cfg,
                        scaling=LORA.scaling)  # fmt: skip
    assert reader.names() == base.names() and reader.info == base.info
    changed = 0
    for name in reader.names():
        assert torch.equal(reader.tensor(name), want[name]), name
        changed += not torch.equal(want[name], base.tensor(name))
    assert changed == 2 * 4  # 2 layers x qkv, proj, fc1, fc2
    assert main(["reshard", "--load", str(root / "lora"), "--save", str(tmp_path / "r1"), "--target-tp", "1",
                 "--target-pp", "1"]) == 0  # fmt: skip
    resharded = open_checkpoint(tmp_path / "r1")
    assert all(torch.equal(resharded.tensor(n), want[n]) for n in want)


def test_an_adapter_recording_its_base_under_w1_still_loads(exported, tmp_path: Path, capsys) -> None:
    """Adapters written before the w2 fingerprint record their base as ``w1:``: every reader
    hashes the base under w1 to check it (never under w2, which could not match), and another
    base is still refused."""
    from finetune.sft.source import _rehash
    from pretrain.checkpoint.lora_adapter import check_base

    root = exported["root"]
    adapter = read_adapter(root / "lora")
    assert adapter.base.fingerprint.startswith("w2:")
    w1 = weights_fingerprint(open_checkpoint(root / "ck"), scheme="w1")
    old = LoraAdapter(lora=adapter.lora, base=LoraBase(path=str(root / "ck"), fingerprint=w1),
                      iteration=5, tensors=adapter.tensors)  # fmt: skip
    write_adapter_checkpoint(tmp_path / "old", old)
    merged = open_checkpoint(root / "lora")
    reader = open_checkpoint(tmp_path / "old")  # open_lora
    assert all(torch.equal(reader.tensor(n), merged.tensor(n)) for n in merged.names())
    assert main(["to-hf", "--load", str(tmp_path / "old"), "--save", str(tmp_path / "hf"), "--lora-as",
                 "adapter", "--weights-only"]) == 0  # fmt: skip
    assert (
        load_file(tmp_path / "hf" / "adapter_model.safetensors").keys()
        == load_file(root / "adapter" / "adapter_model.safetensors").keys()
    )
    # SFT from a LoRA checkpoint holds its base's w2 value: it re-hashes the base under w1
    w2 = weights_fingerprint(open_checkpoint(root / "ck"))
    check_base(old, w2, where="--ckpt", recompute=lambda scheme: _rehash(str(root / "ck"), False, scheme))
    with pytest.raises(UserError, match="records its base under fingerprint scheme w1"):
        check_base(old, w2, where="--ckpt")
    wrong = LoraAdapter(lora=adapter.lora, base=LoraBase(path=str(root / "ck"), fingerprint="w1:" + "0" * 64),
                        iteration=5, tensors=adapter.tensors)  # fmt: skip
    write_adapter_checkpoint(tmp_path / "wrong", wrong)
    err = one_line_error(main, ["to-hf", "--load", str(tmp_path / "wrong"), "--save", str(tmp_path / "x"),
                                "--weights-only"], capsys)  # fmt: skip
    assert "(fingerprint w1:" in err and "are not the ones this LoRA adapter was trained on" in err


@pytest.mark.parametrize("case", ["llama3", "llama_linear_tied", "mistral", "qwen2", "qwen3"])
def test_a_peft_adapter_of_every_llama_family_round_trips(case: str, tmp_path: Path) -> None:
    """PEFT-trained adapter -> ``from-hf --adapter`` -> ``to-hf --lora-as adapter`` / ``merged``:
    PEFT loads our adapter as the model it trained, and the merged export equals it (Qwen2's QKV
    bias, Qwen3's head_dim != hidden / heads and QK-norm, a tied head)."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from tests.llama_fixtures import hf_model

    hf_model(case).save_pretrained(tmp_path / "hf")
    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    pm = get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "hf"),
                        LoraConfig(r=2, lora_alpha=4, target_modules=modules))  # fmt: skip
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    trained = _logits(pm)
    pm.save_pretrained(str(tmp_path / "peft"))
    assert main(["from-hf", "--load", str(tmp_path / "hf"), "--adapter", str(tmp_path / "peft"), "--save",
                 str(tmp_path / "lora"), "--weights-only"]) == 0  # fmt: skip
    for kind in ("adapter", "merged"):
        assert main(["to-hf", "--load", str(tmp_path / "lora"), "--save", str(tmp_path / kind), "--lora-as", kind,
                     "--weights-only"]) == 0  # fmt: skip
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert torch.equal(_logits(PeftModel.from_pretrained(base, str(tmp_path / "adapter"))), trained)
    merged = _logits(AutoModelForCausalLM.from_pretrained(tmp_path / "merged"))
    assert (merged - trained).abs().max() <= 1e-5
    assert (trained - _logits(AutoModelForCausalLM.from_pretrained(tmp_path / "hf"))).abs().max() > 1e-2
