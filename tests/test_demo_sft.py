"""``make demo``'s SFT + LoRA step: LoRA SFT at tp2 on the built-in chat data, exported as a PEFT
adapter that ``peft`` loads equal to the merged export (``finetune.sft.peft_check``); its refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli_helpers import one_line_error
from tests.fresh_demo import FreshDemo

pytest.importorskip("peft")


@pytest.mark.slow
def test_demo_sft_lora_step(fresh_demo: FreshDemo) -> None:
    """The demo (the run ``tests/test_docs_report.py`` checks too) trained, exported and checked its adapter."""
    assert fresh_demo.returncode == 0, fresh_demo.log[-3000:]
    check = json.loads([x for x in fresh_demo.log.splitlines() if x.startswith('{"max_abs_diff"')][-1])
    assert check["max_abs_diff"] <= 1e-5 and check["max_abs_change"] > 0
    rec = json.loads((fresh_demo.out / "sft_lora_results" / "results.json").read_text())
    assert rec["details"]["lora"]["rank"] == 8
    assert (fresh_demo.out / "sft_adapter" / "adapter_config.json").is_file()


def test_peft_check_refusals_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from finetune.sft.peft_check import main

    err = one_line_error(main, ["--base", str(tmp_path), "--adapter", str(tmp_path), "--merged", str(tmp_path)],
                         capsys)  # fmt: skip
    assert "--adapter" in err and "adapter_config.json" in err
    (tmp_path / "adapter_config.json").write_text("{}")
    err = one_line_error(main, ["--base", str(tmp_path), "--adapter", str(tmp_path), "--merged", str(tmp_path),
                                "--data", str(tmp_path / "none.jsonl")], capsys)  # fmt: skip
    assert "--data" in err


def test_peft_check_fails_when_the_adapter_differs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An adapter that is not the merged model's (here: merged = base, so it also changes nothing) exits 1."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from finetune.sft.peft_check import main
    from finetune.sft.tiny_model import write_tiny_chat_llama

    base = write_tiny_chat_llama(tmp_path / "base", hidden=32, layers=1)
    peft = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base), LoraConfig(r=2, target_modules=["q_proj"])
    )
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.fill_(0.1)
    peft.save_pretrained(tmp_path / "adapter")
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "What is 2 plus 3?"}]}) + "\n")
    argv = [
        "--base",
        str(base),
        "--adapter",
        str(tmp_path / "adapter"),
        "--merged",
        str(base),
        "--data",
        str(data),
    ]
    assert main(argv) == 1
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["max_abs_diff"] > 1e-5 and out["max_abs_change"] == 0.0
