"""Reading PEFT adapters: only a plain LoRA on its base is imported. Each variant is built and
saved by ``peft`` itself; those whose ``PeftModel.from_pretrained`` computes something other than
``W + s B A`` on the given base are refused in one line, and PEFT's conversion of such an adapter
to a plain one then imports exactly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from pretrain.utils.errors import UserError
from tests.cli_helpers import one_line_error
from tests.lora_fixtures import tiny_hf
from tools.convert.peft_config import MUST_BE_DEFAULT, NO_EFFECT, check_plain_lora
from tools.convert_cli import main

pytest.importorskip("peft")
IDS = torch.randint(7, 301, (2, 20), generator=torch.Generator().manual_seed(1))
IDS[:, 4:6] = torch.tensor([5, 6])  # aLoRA's invocation tokens below: its update acts from there on
TARGETS = ["q_proj", "k_proj", "v_proj", "down_proj"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("peft_variants") / "hf"
    tiny_hf("llama3").save_pretrained(path)
    return path


def _peft(hf_dir: Path, **kw: Any) -> Any:
    """A PEFT LoRA model on the base at ``hf_dir`` with B moved off its init ("trained")."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    pm = get_peft_model(AutoModelForCausalLM.from_pretrained(hf_dir),
                        LoraConfig(r=2, lora_alpha=4, target_modules=TARGETS, **kw))  # fmt: skip
    with torch.no_grad():
        gen = torch.Generator().manual_seed(3)
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return pm


def _logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(IDS).logits  # type: ignore[no-any-return]


def _peft_loaded(hf_dir: Path, adapter: Path) -> torch.Tensor:
    """What ``PeftModel.from_pretrained`` on the plain base computes with ``adapter``."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    return _logits(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(hf_dir), adapter))


def _imported_merged(hf_dir: Path, adapter: Path, out: Path) -> torch.Tensor:
    """Our ``from-hf --adapter --adapter-as merged`` then ``to-hf``, run in transformers."""
    from transformers import AutoModelForCausalLM

    argv = ["from-hf", "--load", str(hf_dir), "--adapter", str(adapter), "--adapter-as", "merged",
            "--save", str(out / "ck"), "--weights-only"]  # fmt: skip
    assert main(argv) == 0
    assert main(["to-hf", "--load", str(out / "ck"), "--save", str(out / "hf"), "--weights-only"]) == 0
    return _logits(AutoModelForCausalLM.from_pretrained(out / "hf"))


def _refused(hf_dir: Path, adapter: Path, out: Path, capsys: pytest.CaptureFixture[str]) -> str:
    argv = ["from-hf", "--load", str(hf_dir), "--adapter", str(adapter), "--save", str(out), "--weights-only"]
    capsys.readouterr()  # transformers' progress bars from building the adapter
    err = one_line_error(main, argv, capsys)
    assert not out.exists()
    return err


def test_a_plain_adapter_with_every_peft_field_imports_as_peft_loads_it(hf_dir: Path, tmp_path: Path) -> None:
    _peft(hf_dir).save_pretrained(tmp_path / "plain")
    saved = json.loads((tmp_path / "plain" / "adapter_config.json").read_text())
    assert {"alora_invocation_tokens", "use_qalora", "lora_bias"} <= saved.keys()  # peft writes them all
    got = _imported_merged(hf_dir, tmp_path / "plain", tmp_path / "out")
    assert (got - _peft_loaded(hf_dir, tmp_path / "plain")).abs().max() <= 1e-5


@pytest.mark.parametrize(
    ("variant", "field"),
    [
        (
            {"init_lora_weights": "pissa"},
            "init_lora_weights='pissa' trains against a base its initialisation changed",
        ),
        (
            {"init_lora_weights": "pissa_niter_2"},
            "init_lora_weights='pissa_niter_2' trains against a base its initialisation changed",
        ),
        (
            {"init_lora_weights": "olora"},
            "init_lora_weights='olora' trains against a base its initialisation changed",
        ),
        ({"alora_invocation_tokens": [5, 6]}, "alora_invocation_tokens=[5, 6] is not supported"),
    ],
)
def test_variants_peft_loads_as_another_function_are_refused(
    hf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], variant: dict[str, Any], field: str
) -> None:
    """Read as plain LoRA these would differ from the trained model by 0.2-0.4 in the logits."""
    pm = _peft(hf_dir, **variant)
    pm.save_pretrained(tmp_path / "variant")
    err = _refused(hf_dir, tmp_path / "variant", tmp_path / "out", capsys)
    assert "adapter_config.json: " + field in err
    # what a plain read would have merged: the tensors alone, as if the field were not there
    conf_path = tmp_path / "variant" / "adapter_config.json"
    conf = json.loads(conf_path.read_text())
    conf.update(init_lora_weights=True, alora_invocation_tokens=None)
    conf_path.write_text(json.dumps(conf))
    naive = _imported_merged(hf_dir, tmp_path / "variant", tmp_path / "naive")
    assert (naive - _logits(pm)).abs().max() > 1e-2  # the refusal is not over-cautious


def test_pissa_converted_by_peft_to_plain_lora_imports_exactly(
    hf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The refusal's advice: PEFT's conversion (rank 2 r on the original base) is read, and equals
    the trained PiSSA model and PEFT's own load of the converted adapter."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    pm = get_peft_model(AutoModelForCausalLM.from_pretrained(hf_dir),
                        LoraConfig(r=2, lora_alpha=4, target_modules=TARGETS, init_lora_weights="pissa"))  # fmt: skip
    config: Any = pm.peft_config["default"]
    config.init_lora_weights = True  # PEFT's recipe: the initial adapter, saved plain
    pm.save_pretrained(str(tmp_path / "initial"))
    config.init_lora_weights = "pissa"
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(4)))
    trained = _logits(pm)
    pm.save_pretrained(str(tmp_path / "raw"))
    assert "init_lora_weights='pissa'" in _refused(hf_dir, tmp_path / "raw", tmp_path / "x", capsys)
    pm.save_pretrained(
        str(tmp_path / "converted"), path_initial_model_for_weight_conversion=str(tmp_path / "initial")
    )
    assert json.loads((tmp_path / "converted" / "adapter_config.json").read_text())["r"] == 4
    got = _imported_merged(hf_dir, tmp_path / "converted", tmp_path / "out")
    assert (got - trained).abs().max() <= 1e-4
    assert (got - _peft_loaded(hf_dir, tmp_path / "converted")).abs().max() <= 1e-5


@pytest.mark.parametrize(
    ("variant", "field"),
    [
        ({"lora_bias": True}, "lora_bias=True is not supported"),
        ({"use_rslora": True}, "use_rslora=True is not supported"),
        ({"trainable_token_indices": [1, 2]}, "trainable_token_indices=[1, 2] is not supported"),
    ],
)
def test_other_variants_are_refused_by_name(
    hf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], variant: dict[str, Any], field: str
) -> None:
    _peft(hf_dir, **variant).save_pretrained(tmp_path / "variant")
    assert "adapter_config.json: " + field in _refused(hf_dir, tmp_path / "variant", tmp_path / "out", capsys)


def test_a_field_this_reader_does_not_know_is_refused_unless_empty(
    hf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _peft(hf_dir).save_pretrained(tmp_path / "a")
    conf_path = tmp_path / "a" / "adapter_config.json"
    conf = json.loads(conf_path.read_text())
    conf_path.write_text(json.dumps({**conf, "future_variant": None, "future_config": {}}))
    assert main(["from-hf", "--load", str(hf_dir), "--adapter", str(tmp_path / "a"), "--save",
                 str(tmp_path / "ok"), "--weights-only"]) == 0  # fmt: skip
    conf_path.write_text(json.dumps({**conf, "future_config": {"blocks": 4}}))
    err = _refused(hf_dir, tmp_path / "a", tmp_path / "out", capsys)
    assert "future_config={'blocks': 4} is a field this reader does not know" in err


def test_every_field_of_peft_lora_config_is_classified() -> None:
    """A field a later ``peft`` adds must be looked at (and put in one of the tables), not passed."""
    import dataclasses

    from peft import LoraConfig

    fields = {f.name for f in dataclasses.fields(LoraConfig)}
    unclassified = fields - NO_EFFECT - MUST_BE_DEFAULT.keys() - {"init_lora_weights"}
    assert not unclassified
    defaults = LoraConfig(target_modules=TARGETS).to_dict()
    check_plain_lora(json.loads(json.dumps(defaults, default=str)), Path("adapter_config.json"))


@pytest.mark.parametrize("init", ["corda", "loftq", "lora_ga", "pissa_niter_16", "mystery"])
def test_other_base_changing_or_unknown_inits_are_refused(init: str) -> None:
    """Those that need data or quantization to build (CorDA, LoftQ, LoRA-GA), checked on the config."""
    with pytest.raises(UserError, match=f"init_lora_weights='{init}'"):
        check_plain_lora({"peft_type": "LORA", "init_lora_weights": init}, Path("adapter_config.json"))
    for plain in (True, False, "gaussian", "eva", "orthogonal", "mica"):
        check_plain_lora({"peft_type": "LORA", "init_lora_weights": plain}, Path("adapter_config.json"))
