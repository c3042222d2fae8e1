"""``mlm-generate`` prints the same text from ``--ckpt`` and ``--hf-model`` (issue 25 item 11): the
generated text is what Hugging Face users read from ``generate`` + ``decode(...,
skip_special_tokens=True)`` (as the text-generation pipeline returns), so an end-of-text token is
never printed, streaming or ``--json``."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from mlm_eval.generation.cli import main as generate_main
from tools.convert_cli import main as convert_main

pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
PROMPT = "the quick brown fox"


def _eos_soon(src: Path, dst: Path) -> Path:
    """``src`` (a GPT-2) rigged so that greedy decoding of :data:`PROMPT` ends with
    ``<|endoftext|>`` after a few tokens: the position embeddings from there on point along the
    end-of-text embedding (the output layer is tied to it)."""
    from transformers import AutoTokenizer, GPT2LMHeadModel

    model: Any = GPT2LMHeadModel.from_pretrained(src)
    start = len(AutoTokenizer.from_pretrained(src).encode(PROMPT)) + 3
    with torch.no_grad():
        eos = model.transformer.wte.weight[model.config.eos_token_id]
        model.transformer.wpe.weight[start:] += 20 * eos / eos.norm()
    shutil.copytree(src, dst)
    model.save_pretrained(dst)
    return dst


@pytest.fixture(scope="module")
def dirs(tiny_gpt2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gen-text")
    hf = _eos_soon(tiny_gpt2_dir, root / "hf")
    assert convert_main(["from-hf", "--load", str(hf), "--save", str(root / "ck")]) == 0
    return {"hf": hf, "ck": root / "ck"}


def _run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    capsys.readouterr()
    assert generate_main([*argv, "--prompt", PROMPT, "--max-new-tokens", "12"]) == 0
    return capsys.readouterr().out


def test_the_fixture_generates_end_of_text(dirs: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model: Any = AutoModelForCausalLM.from_pretrained(dirs["hf"]).eval()
    tok = AutoTokenizer.from_pretrained(dirs["hf"])
    ids = torch.tensor([tok.encode(PROMPT)])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.eos_token_id)
    new = out[0, ids.shape[1] :].tolist()
    assert tok.eos_token_id in new[1:]  # after some text


@pytest.mark.parametrize("mode", ["stream", "json"])
def test_ckpt_and_hf_model_print_the_same_text(
    dirs: dict[str, Path], capsys: pytest.CaptureFixture[str], mode: str
) -> None:
    extra = ["--json"] if mode == "json" else []
    ours = _run(capsys, ["--ckpt", str(dirs["ck"]), *extra])
    theirs = _run(capsys, ["--hf-model", str(dirs["hf"]), *extra])
    assert ours == theirs
    assert "<|endoftext|>" not in theirs
    if mode == "json":
        assert json.loads(ours)["tokens"] == json.loads(theirs)["tokens"]
    else:
        assert theirs.startswith(PROMPT) and theirs.endswith("\n")
