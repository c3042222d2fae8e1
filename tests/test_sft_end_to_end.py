"""After SFT on the built-in chat data, the checkpoint chats: ``mlm-generate --apply-chat-template``
answers a trained question in the trained format (the answer, then the template's ``<|im_end|>``
ends it), and ``mlm-lm-eval --apply_chat_template`` runs on the SFT checkpoint with its prompts
rendered as transformers' ``apply_chat_template`` renders them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from finetune.sft.tiny_tokenizer import CHAT_TEMPLATE_FILE, SFT_CHAT_FILE
from tests.cli_helpers import one_line_error
from tests.sft_fixtures import make_chat_llama

# a few conversations from the built-in data, learnt by heart by a tiny Llama
# (without a system message: the prompt is one user message)
CONVERSATIONS = [
    c
    for c in map(json.loads, SFT_CHAT_FILE.read_text(encoding="utf-8").splitlines())
    if len(c["messages"]) == 2
][:3]


@pytest.fixture(scope="module")
def sft_ckpt(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from finetune.cli import main

    root = tmp_path_factory.mktemp("sft_e2e")
    base = make_chat_llama(root / "base")
    data = root / "chat.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS), encoding="utf-8")
    save = root / "sft"
    argv = ["sft", "--hf-model", str(base), "--data", str(data), "--seq-length", "64", "--epochs", "60",
            "--global-batch-size", "3", "--micro-batch-size", "3", "--lr", "1e-2", "--min-lr", "1e-2",
            "--save", str(save), "--results-dir", str(root / "res"), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    return {"base": base, "ckpt": save, "root": root}


def _generate(argv: list[str], capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    from mlm_eval.generation.cli import main

    capsys.readouterr()
    assert main(argv) == 0
    return [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]


def test_generate_with_the_chat_template_answers_in_the_trained_format(
    sft_ckpt: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    questions = [c["messages"][-2]["content"] for c in CONVERSATIONS]
    answers = [c["messages"][-1]["content"] for c in CONVERSATIONS]
    flags = ["--max-new-tokens", "24", "--json", *[a for q in questions for a in ("--prompt", q)]]
    rows = _generate(["--ckpt", str(sft_ckpt["ckpt"]), "--apply-chat-template", *flags], capsys)
    assert [r["text"] for r in rows] == answers
    # stopped by the template's end of turn (<|im_end|>, the tokenizer's eos), not by the length
    assert all(len(r["tokens"]) < 24 for r in rows)
    # the same with the template given as a file, and with transformers on the Hugging Face export
    again = _generate(
        ["--ckpt", str(sft_ckpt["ckpt"]), "--chat-template", str(CHAT_TEMPLATE_FILE), *flags], capsys
    )
    assert again == rows
    # without the template the model sees plain text: not the trained format
    plain = _generate(["--ckpt", str(sft_ckpt["ckpt"]), *flags], capsys)
    assert [r["text"] for r in plain] != answers


def test_hf_export_generates_the_same_with_the_chat_template(
    sft_ckpt: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    from tools.convert_cli import main as convert

    hf = sft_ckpt["root"] / "hf"
    if not hf.exists():
        assert convert(["to-hf", "--load", str(sft_ckpt["ckpt"]), "--save", str(hf)]) == 0
    flags = ["--max-new-tokens", "24", "--json", "--apply-chat-template", "--prompt",
             CONVERSATIONS[0]["messages"][-2]["content"]]  # fmt: skip
    ours = _generate(["--ckpt", str(sft_ckpt["ckpt"]), *flags], capsys)
    theirs = _generate(["--hf-model", str(hf), *flags], capsys)
    assert theirs == ours and ours[0]["text"] == CONVERSATIONS[0]["messages"][-1]["content"]


def test_rendered_prompt_is_transformers_apply_chat_template(sft_ckpt: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    from pretrain.tokenizer.chat import render_chat
    from pretrain.tokenizer.hf import HuggingFaceTokenizer

    ours = HuggingFaceTokenizer(sft_ckpt["base"])
    theirs: Any = AutoTokenizer.from_pretrained(sft_ckpt["base"])
    msgs = CONVERSATIONS[0]["messages"]
    for gen, chat in ((True, msgs[:-1]), (False, msgs)):
        want = theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen,
                                          continue_final_message=not gen)  # fmt: skip
        text = render_chat(ours, chat, add_generation_prompt=gen)
        assert text == want
        assert (
            ours.tokenize(text)
            == theirs.apply_chat_template(
                chat,
                tokenize=True,
                add_generation_prompt=gen,
                continue_final_message=not gen,
                return_dict=True,
            )["input_ids"]
        )


def test_chat_template_errors_are_one_line(
    sft_ckpt: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from mlm_eval.generation.cli import main

    missing = tmp_path / "none.jinja"
    err = one_line_error(
        main, ["--ckpt", str(sft_ckpt["ckpt"]), "--prompt", "hi", "--chat-template", str(missing)], capsys
    )
    assert "--chat-template" in err and str(missing) in err


@pytest.mark.slow  # 2.4-15 s on a 2-core host: out of the fast lane (under 2 min)
def test_lm_eval_with_apply_chat_template_runs_on_the_sft_checkpoint(
    sft_ckpt: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("lm_eval")
    from mlm_eval.harness.cli import main
    from mlm_eval.harness.tasks import TASKS_DIR
    from tests.lm_eval_index import install

    install()  # the harness's own task index built once per test process
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "lm_eval"
    argv = ["--model", "mlm", "--model_args", f"ckpt={sft_ckpt['ckpt']},batch_size=4", "--include_path",
            str(TASKS_DIR), "--tasks", "mlm_sample_gen,mlm_sample_mc", "--limit", "3", "--device", "cpu",
            "--apply_chat_template", "--output_path", str(out), "--log_samples"]  # fmt: skip
    assert main(argv) == 0
    (results_file,) = out.rglob("results_*.json")
    results = json.loads(results_file.read_text())
    assert set(results["results"]) == {"mlm_sample_gen", "mlm_sample_mc"}
    assert results["chat_template"] == CHAT_TEMPLATE_FILE.read_text(encoding="utf-8")
    (samples,) = out.rglob("samples_mlm_sample_gen_*.jsonl")
    prompt = json.loads(samples.read_text().splitlines()[0])["arguments"]["gen_args_0"]["arg_0"]
    assert prompt.startswith("<|im_start|>user\n") and prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
