"""``mlm-finetune sft --lora-rank``: only the adapters train (the base stays bitwise); the saved LoRA
checkpoint evaluates to the run's valid_loss and, exported as a PEFT adapter, gives the same
valid_loss in ``peft`` + transformers; pp2 x dp2 with ZeRO-1 equals one process (slow)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from finetune.cli import main
from finetune.sft.tiny_tokenizer import SFT_CHAT_FILE
from tests.cli_helpers import one_line_error
from tests.sft_fixtures import chat_messages, make_chat_llama

pytest.importorskip("peft")
LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "qkv,proj,fc1,fc2"]
TRAIN = ["--data", str(SFT_CHAT_FILE), "--valid-data", str(SFT_CHAT_FILE), "--seq-length", "128", "--pack",
         "--global-batch-size", "4", "--micro-batch-size", "2", "--epochs", "1", "--lr", "1e-2", "--no-progress"]  # fmt: skip


@pytest.fixture(scope="module")
def chat_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_chat_llama(tmp_path_factory.mktemp("chat_llama_lora"))


def _peft_loss(base: Path, adapter: Path, conversations: list[list[dict[str, str]]]) -> tuple[float, int]:
    """Mean NLL over transformers' assistant tokens of the PEFT-adapted model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    model: Any = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval()
    total, count = 0.0, 0
    for msgs in conversations:
        out = tok.apply_chat_template(msgs, return_dict=True, return_assistant_tokens_mask=True)
        ids, mask = torch.tensor(out["input_ids"]), torch.tensor(out["assistant_masks"][1:], dtype=torch.bool)
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids[None]).logits[0, :-1].double(), dim=-1)
        total -= float(logp.gather(1, ids[1:, None])[:, 0][mask].sum())
        count += int(mask.sum())
    return total / count, count


def test_lora_sft_trains_adapters_only_and_exports_to_peft(chat_llama: Path, tmp_path: Path) -> None:
    from pretrain.checkpoint.lora_adapter import read_adapter
    from tools.convert_cli import main as convert

    save, out = tmp_path / "lora_ck", tmp_path / "res"
    assert (
        main(
            [
                "sft",
                "--hf-model",
                str(chat_llama),
                *TRAIN,
                *LORA,
                "--save",
                str(save),
                "--results-dir",
                str(out),
            ]
        )
        == 0
    )
    rec = json.loads((out / "results.json").read_text())
    assert rec["details"]["lora"] == {
        "rank": 4,
        "alpha": 8.0,
        "dropout": 0.0,
        "targets": ["qkv", "proj", "fc1", "fc2"],
    }
    adapter = read_adapter(save)
    assert adapter.base.path == str(chat_llama.resolve()) and adapter.lora.rank == 4
    assert any(
        float(t.abs().max()) > 0 for n, t in adapter.tensors.items() if "lora_B" in n
    )  # B moved off zero
    # the saved checkpoint: its base (fingerprint checked) plus the adapter -> the run's own valid_loss
    again = tmp_path / "again"
    assert main(["sft", "--ckpt", str(save), "--data", str(SFT_CHAT_FILE), "--eval-only", "--seq-length", "128",
                 "--results-dir", str(again)]) == 0  # fmt: skip
    got = json.loads((again / "results.json").read_text())["metrics"]
    want = rec["metrics"]
    assert got["valid_loss_tokens"] == want["valid_loss_tokens"]
    assert abs(got["valid_loss"] - want["valid_loss"]) <= 1e-6 * want["valid_loss"]
    # exported as a PEFT adapter: peft + transformers on the base give the same valid_loss
    assert (
        convert(["to-hf", "--load", str(save), "--save", str(tmp_path / "peft"), "--lora-as", "adapter"]) == 0
    )
    theirs = _peft_loss(chat_llama, tmp_path / "peft", chat_messages(SFT_CHAT_FILE))
    assert theirs[1] == want["valid_loss_tokens"]
    assert abs(theirs[0] - want["valid_loss"]) <= 1e-6 * want["valid_loss"]


def test_lora_training_leaves_the_base_bitwise(chat_llama: Path) -> None:
    from finetune.sft.packing import pad_rows
    from finetune.sft.samples import Sample
    from finetune.sft.source import load_decoder
    from finetune.sft.task import SFTTask
    from pretrain.models.lora import LoraConfig, is_lora_name
    from pretrain.models.sharding import gather_full_state_dict
    from pretrain.optim.config import LRScheduleConfig, OptimizerConfig
    from pretrain.parallel.state import ParallelState
    from pretrain.training.config import TrainingConfig
    from pretrain.training.loop import train

    dec = load_decoder(ckpt=None, hf_model=str(chat_llama))
    ids = torch.randint(3, 300, (6, 20))
    rows = pad_rows(
        [Sample(ids=i.numpy(), loss=torch.ones(20, dtype=torch.bool).numpy()) for i in ids], 24, 0
    )
    cfg = TrainingConfig(
        micro_batch_size=2, global_batch_size=6, train_iters=2, seq_length=24, progress=False
    )
    task = SFTTask(model_cfg=dec.cfg, train_cfg=cfg, rows=rows, pretrained=dec.tensors,
                   lora=LoraConfig(rank=2, alpha=4.0), lora_base=dec.base_of())  # fmt: skip
    result = train(task, ps=ParallelState.single(), optim_cfg=OptimizerConfig(lr=1e-2, weight_decay=0.1),
                   lr_cfg=LRScheduleConfig(lr=1e-2, min_lr=1e-2, decay_style="constant"), cfg=cfg, ckpt_args=None)  # fmt: skip
    trained = [m.key for m in result["trainer"].optimizer.mains]  # what the optimizer steps
    (chunk,) = task.chunks
    full = gather_full_state_dict(chunk)
    assert all(p.requires_grad == is_lora_name(n) for n, p in chunk.named_parameters())
    for key, tensor in dec.tensors.items():
        assert torch.equal(full[key], tensor), key
    assert trained and all(is_lora_name(k) for k in trained), trained


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--lora-alpha", "8"], "--lora-alpha needs --lora-rank R"),
        (["--lora-dropout", "0.1", "--lora-targets", "qkv"], "--lora-dropout needs --lora-rank R"),
        (["--lora-rank", "0"], "--lora-rank: must be a positive integer, got 0"),
        (["--lora-rank", "4", "--lora-targets", "qkv,mlp"], "--lora-targets: 'qkv,mlp' is not"),
        (["--lora-rank", "4", "--fp16"], "--fp16 with --lora-rank"),
    ],
)
def test_lora_flag_errors_are_one_line(
    chat_llama: Path, capsys: pytest.CaptureFixture[str], flags: list[str], needle: str
) -> None:
    argv = ["sft", "--hf-model", str(chat_llama), "--data", str(SFT_CHAT_FILE), *flags]
    assert needle in one_line_error(main, argv, capsys)


def test_lora_flags_give_the_config_they_ask_for() -> None:
    """``--lora-rank`` alone: alpha = r (PEFT's scaling 1), no dropout, every target; the rest as given."""
    from pretrain.models.lora import ALL_TARGETS, LoraConfig, LoraFlags

    assert LoraFlags().config() is None
    assert LoraFlags(lora_rank=4).config() == LoraConfig(rank=4, alpha=4.0, dropout=0.0, targets=ALL_TARGETS)
    given = LoraFlags(lora_rank=8, lora_alpha=16, lora_dropout=0.05, lora_targets="qkv, fc2").config()
    assert given == LoraConfig(rank=8, alpha=16.0, dropout=0.05, targets=("qkv", "fc2"))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("layout", "flags"),
    [("tp1-pp2-dp2", ["--pp", "2", "--use-distributed-optimizer"]), ("tp2-pp1-dp2", ["--tp", "2"])],
)
def test_lora_in_parallel_equals_one_process(
    chat_llama: Path, tmp_path: Path, layout: str, flags: list[str]
) -> None:
    """Losses, valid_loss and the adapter weights after LoRA SFT: pp2 x dp2 with ZeRO-1, and tp2 x dp2,
    equal one process."""
    from pretrain.checkpoint.lora_adapter import read_adapter
    from tests.distributed import launch

    argv = ["sft", "--hf-model", str(chat_llama), *TRAIN, *LORA]
    assert main([*argv, "--save", str(tmp_path / "ck1"), "--results-dir", str(tmp_path / "one")]) == 0
    proc = launch(4, "finetune.cli", [*argv, *flags, "--save",
                                        str(tmp_path / "ck4"), "--results-dir", str(tmp_path / "four")])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, four = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("one", "four"))
    assert four["details"]["layout"] == layout
    torch.testing.assert_close(torch.tensor(four["details"]["train_losses"]), torch.tensor(one["details"]["train_losses"]),
                               rtol=1e-5, atol=0)  # fmt: skip
    assert (
        abs(four["metrics"]["valid_loss"] - one["metrics"]["valid_loss"])
        <= 1e-5 * one["metrics"]["valid_loss"]
    )
    a1, a4 = read_adapter(tmp_path / "ck1").tensors, read_adapter(tmp_path / "ck4").tensors
    assert a1.keys() == a4.keys()
    for name in a1:
        torch.testing.assert_close(a4[name], a1[name], rtol=1e-4, atol=1e-6, msg=name)
