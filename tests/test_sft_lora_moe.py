"""``mlm-finetune sft --lora-rank`` on a tiny Mixtral: the experts' adapters train, the saved LoRA
checkpoint exports to a PEFT adapter that gives the run's valid_loss in ``peft`` + transformers,
and EP 2 under torchrun equals one process (slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from finetune.cli import main
from finetune.sft.tiny_tokenizer import SFT_CHAT_FILE
from tests.sft_fixtures import chat_messages
from tests.test_sft_lora import LORA, TRAIN, _peft_loss

pytest.importorskip("peft")


def make_chat_mixtral(directory: Path) -> Path:
    """The tiny chat tokenizer and a random tiny Mixtral sized to it, saved in ``directory``."""
    from transformers import AutoTokenizer

    from finetune.sft.tiny_tokenizer import write_tiny_chat_tokenizer
    from tests.moe_hf_fixtures import hf_model

    tok = AutoTokenizer.from_pretrained(write_tiny_chat_tokenizer(directory / "_tok"))
    model = hf_model("mixtral", vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                     pad_token_id=tok.pad_token_id, max_position_embeddings=128)  # fmt: skip
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def chat_mixtral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_chat_mixtral(tmp_path_factory.mktemp("chat_mixtral_lora"))


def _train(base: Path, tmp: Path, name: str) -> dict[str, object]:
    argv = ["sft", "--hf-model", str(base), *TRAIN, *LORA, "--save", str(tmp / f"ck_{name}"),
            "--results-dir", str(tmp / name)]  # fmt: skip
    assert main(argv) == 0
    return json.loads((tmp / name / "results.json").read_text())


def test_lora_sft_on_moe_trains_the_experts_and_exports_to_peft(chat_mixtral: Path, tmp_path: Path) -> None:
    from pretrain.checkpoint.lora_adapter import read_adapter
    from tools.convert_cli import main as convert

    rec = _train(chat_mixtral, tmp_path, "one")
    adapter = read_adapter(tmp_path / "ck_one")
    experts = [n for n in adapter.tensors if ".mlp.experts." in n and "lora_B" in n]
    assert len(experts) == 4 * 6 * 2 and not any("router" in n for n in adapter.tensors)
    assert (
        sum(float(adapter.tensors[n].abs().max()) > 0 for n in experts) > len(experts) // 2
    )  # routed ones moved
    out = tmp_path / "peft"
    assert (
        convert(["to-hf", "--load", str(tmp_path / "ck_one"), "--save", str(out), "--lora-as", "adapter"])
        == 0
    )
    theirs = _peft_loss(chat_mixtral, out, chat_messages(SFT_CHAT_FILE))
    want = rec["metrics"]
    assert theirs[1] == want["valid_loss_tokens"]  # type: ignore[index]
    assert abs(theirs[0] - want["valid_loss"]) <= 1e-6 * want["valid_loss"]  # type: ignore[index,operator]


@pytest.mark.slow
def test_lora_sft_at_ep2_equals_one_process(chat_mixtral: Path, tmp_path: Path) -> None:
    """Losses, valid_loss and every adapter (each EP rank's experts in the saved checkpoint)."""
    from pretrain.checkpoint.lora_adapter import read_adapter
    from tests.distributed import launch

    one = _train(chat_mixtral, tmp_path, "one")
    argv = ["sft", "--hf-model", str(chat_mixtral), *TRAIN, *LORA, "--expert-model-parallel-size", "2",
            "--save", str(tmp_path / "ck_ep"), "--results-dir", str(tmp_path / "ep")]  # fmt: skip
    proc = launch(2, "finetune.cli", argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ep = json.loads((tmp_path / "ep" / "results.json").read_text())
    torch.testing.assert_close(torch.tensor(ep["details"]["train_losses"]), torch.tensor(one["details"]["train_losses"]),  # type: ignore[index]
                               rtol=1e-5, atol=0)  # fmt: skip
    assert (
        abs(ep["metrics"]["valid_loss"] - one["metrics"]["valid_loss"]) <= 1e-5 * one["metrics"]["valid_loss"]
    )  # type: ignore[index,operator]
    a1, a2 = read_adapter(tmp_path / "ck_one").tensors, read_adapter(tmp_path / "ck_ep").tensors
    assert a1.keys() == a2.keys()
    for name in a1:
        torch.testing.assert_close(
            a2[name], a1[name], rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )
