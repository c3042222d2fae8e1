"""Full-parameter ``mlm-finetune sft``: the first three optimizer steps equal a plain PyTorch loop
on the Hugging Face model (same batches, AdamW, LR, clipping); ``--save`` exports with ``to-hf``;
bad flags are one line."""

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

LR, WD, STEPS, N = 1e-3, 0.1, 3, 6


@pytest.fixture(scope="module")
def chat_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_chat_llama(tmp_path_factory.mktemp("chat_llama_train"))


def _plain_loop(
    model_dir: Path, conversations: list[list[dict[str, str]]]
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """transformers model + torch AdamW (weight decay on matrices only); every step's batch is all
    conversations (loss: the masked NLL sum over their assistant tokens / their count), gradients
    clipped to norm 1."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir).train()
    decay = [p for p in model.parameters() if p.dim() > 1]  # Megatron's groups: no decay on norms/biases
    rest = [p for p in model.parameters() if p.dim() <= 1]
    groups = [{"params": decay, "weight_decay": WD}, {"params": rest, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.999), eps=1e-8)
    encoded = [
        tok.apply_chat_template(m, return_dict=True, return_assistant_tokens_mask=True) for m in conversations
    ]
    count = sum(sum(e["assistant_masks"][1:]) for e in encoded)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        total = torch.zeros(())
        for e in encoded:
            ids = torch.tensor(e["input_ids"])
            mask = torch.tensor(e["assistant_masks"][1:], dtype=torch.bool)
            logits = model(ids[None]).logits[0, :-1]
            nll = torch.nn.functional.cross_entropy(logits, ids[1:], reduction="none")
            loss = nll[mask].sum() / count
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(total))
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


def test_first_three_steps_equal_a_plain_pytorch_loop(chat_llama: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from tools.convert_cli import main as convert

    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(SFT_CHAT_FILE.read_text().splitlines()[:N]) + "\n")
    save, out = tmp_path / "sft_ckpt", tmp_path / "res"
    assert main(["sft", "--hf-model", str(chat_llama), "--data", str(data), "--valid-data", str(data), "--epochs", str(STEPS),
                 "--global-batch-size", str(N), "--micro-batch-size", "2", "--lr", str(LR), "--lr-decay-style", "constant",
                 "--weight-decay", str(WD), "--seq-length", "128", "--save", str(save), "--results-dir", str(out), "--no-progress"]) == 0  # fmt: skip
    rec = json.loads((out / "results.json").read_text())
    theirs, state = _plain_loop(chat_llama, chat_messages(data))
    assert rec["details"]["iterations"] == STEPS
    torch.testing.assert_close(
        torch.tensor(rec["details"]["train_losses"]), torch.tensor(theirs), rtol=1e-5, atol=0
    )
    assert theirs[-1] < theirs[0] - 0.1  # it learns
    assert convert(["to-hf", "--load", str(save), "--save", str(tmp_path / "hf")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    assert set(exported) == set(state)
    worst = max(float((exported[k] - state[k]).abs().max()) for k in state)
    assert worst < 2e-5, worst  # three AdamW steps of lr 1e-3: fp32 agreement
    moved = max(
        float((exported[k] - v).abs().max())
        for k, v in AutoModelForCausalLM.from_pretrained(chat_llama).state_dict().items()
    )
    assert moved > 1e-3
    assert (tmp_path / "hf" / "chat_template.jinja").is_file() or "chat_template" in (
        tmp_path / "hf" / "tokenizer_config.json"
    ).read_text()
    # the saved checkpoint (our format, tokenizer carried) evaluates to the run's own valid_loss
    again = tmp_path / "again"
    assert main(["sft", "--ckpt", str(save), "--data", str(data), "--eval-only", "--seq-length", "128",
                 "--results-dir", str(again)]) == 0  # fmt: skip
    after = json.loads((again / "results.json").read_text())["metrics"]
    assert after["valid_loss_tokens"] == rec["metrics"]["valid_loss_tokens"]
    assert abs(after["valid_loss"] - rec["metrics"]["valid_loss"]) <= 1e-6 * rec["metrics"]["valid_loss"]
    assert rec["metrics"]["valid_loss"] < theirs[0]


def test_a_chat_template_file_travels_with_the_saved_tokenizer(chat_llama: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    template = tmp_path / "plain.jinja"  # no generation markers: the mask comes from prefix diffing
    template.write_text("{%- for m in messages -%}{{- m['role'] + ': ' + m['content'] + '\\n' -}}{%- endfor -%}"
                        "{%- if add_generation_prompt -%}{{- 'assistant: ' -}}{%- endif -%}")  # fmt: skip
    save = tmp_path / "ck"
    assert main(["sft", "--hf-model", str(chat_llama), "--data", str(SFT_CHAT_FILE), "--chat-template", str(template),
                 "--global-batch-size", "24", "--seq-length", "128", "--save", str(save), "--no-progress"]) == 0  # fmt: skip
    assert AutoTokenizer.from_pretrained(save / "tokenizer").chat_template == template.read_text()


def test_help_shows_the_shared_flag_groups(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit) as exc:
        main(["sft", "--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0 and out.startswith("usage: mlm-finetune sft")
    for flag in ("--tensor-model-parallel-size N, --tp N", "--tokenizer-dir DIR", "--force-tokenizer", "--bf16",
                 "--use-distributed-optimizer", "--loss-on {assistant,completion,all}", "--pack", "--chat-template FILE"):  # fmt: skip
        assert flag in out, flag


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--epochs", "0"], "--epochs must be > 0, got 0"),
        (["--eval-only", "--save", "x"], "--eval-only trains nothing to --save"),
        (
            ["--loss-on", "completion"],
            "--loss-on completion needs prompt/completion records; --data holds chat records",
        ),
        (["--seq-length", "4096"], "--seq-length 4096 exceeds the model's 128 positions"),
        (["--data", "missing.jsonl"], "--data: file not found: missing.jsonl"),
        (["--tp", "2"], "is not divisible by --tp 2 x --pp 1 = 2"),
    ],
)
def test_bad_input_is_one_line(
    chat_llama: Path, capsys: pytest.CaptureFixture[str], flags: list[str], needle: str
) -> None:
    argv = ["sft", "--hf-model", str(chat_llama), "--data", str(SFT_CHAT_FILE), *flags]
    assert needle in one_line_error(main, argv, capsys)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("layout", "flags"),
    [("tp1-pp2-dp2", ["--pp", "2", "--use-distributed-optimizer"]), ("tp2-pp1-dp2", ["--tp", "2"])],
)
def test_packed_training_in_parallel_equals_one_process(
    chat_llama: Path, tmp_path: Path, layout: str, flags: list[str]
) -> None:
    """Losses and valid_loss of 2 packed SFT steps: pp2 x dp2 with ZeRO-1, and tp2 x dp2 = 1 process."""
    from tests.distributed import launch

    argv = ["sft", "--hf-model", str(chat_llama), "--data", str(SFT_CHAT_FILE), "--valid-data", str(SFT_CHAT_FILE),
            "--pack", "--seq-length", "128", "--global-batch-size", "4", "--micro-batch-size", "1", "--epochs", "1",
            "--lr", "1e-3", "--no-progress"]  # fmt: skip
    assert main([*argv, "--results-dir", str(tmp_path / "one")]) == 0
    proc = launch(4, "finetune.cli", [*argv, *flags, "--results-dir",
                                        str(tmp_path / "four")])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, four = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("one", "four"))
    assert four["details"]["layout"] == layout and one["details"]["iterations"] >= 2
    torch.testing.assert_close(torch.tensor(four["details"]["train_losses"]), torch.tensor(one["details"]["train_losses"]),
                               rtol=1e-5, atol=0)  # fmt: skip
    assert (
        abs(four["metrics"]["valid_loss"] - one["metrics"]["valid_loss"])
        <= 1e-5 * one["metrics"]["valid_loss"]
    )


def test_an_encoder_is_refused_in_one_line(tiny_bert_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = one_line_error(
        main, ["sft", "--hf-model", str(tiny_bert_dir), "--data", str(SFT_CHAT_FILE)], capsys
    )
    assert "holds a bert model; SFT needs a decoder" in err
