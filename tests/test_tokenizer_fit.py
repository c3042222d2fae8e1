"""A tokenizer must be able to have made the model's vocabulary rows (issue 25 item 4): from-hf
refuses a 1-token tokenizer for a 1024-row model (unless ``--force-tokenizer``), ``inspect`` calls
such a checkpoint inconsistent and ``mlm-generate`` refuses it, while real models' sizes pass."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from mlm_eval.generation.cli import main as generate_main
from pretrain.tensor_parallel.vocab import padded_vocab_size, rows_fit_tokenizer
from tests.test_tokenizer_travel import _fails
from tools.convert_cli import main as convert_main

pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# (tokens, rows) of published Hugging Face models: their own padding of the embedding
REAL = {
    "Qwen2-0.5B": (151646, 151936), "Qwen2.5-7B": (151665, 152064), "phi-2": (50295, 51200),
    "DeepSeek-V2": (100015, 102400), "Llama-3-8B": (128256, 128256), "gpt2": (50257, 50257),
    "pythia-160m": (50277, 50304), "OLMo-2-1B": (100278, 100352), "bloom": (250680, 250880),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_models_fit(name: str) -> None:
    assert rows_fit_tokenizer(*REAL[name])


@pytest.mark.parametrize("tokens", [600, 8000, 50257, 32000])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_megatron_padding_fits(tokens: int, tp: int) -> None:
    assert rows_fit_tokenizer(tokens, padded_vocab_size(tokens, tp=tp))
    assert rows_fit_tokenizer(tokens, padded_vocab_size(tokens, tp=tp, divisible_by=64), divisible_by=64)


@pytest.mark.parametrize(("tokens", "rows"), [(1, 1024), (300, 1024), (200000, 256000), (1000, 999), (0, 8)])
def test_absurd_sizes_do_not_fit(tokens: int, rows: int) -> None:
    assert not rows_fit_tokenizer(tokens, rows)


def _one_token_gpt2(directory: Path) -> Path:
    """A 1024-row HF GPT-2 whose tokenizer has one token (``<|endoftext|>``)."""
    from tokenizers import Tokenizer, models
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    word = Tokenizer(models.WordLevel({"<|endoftext|>": 0}, unk_token="<|endoftext|>"))
    PreTrainedTokenizerFast(tokenizer_object=word, eos_token="<|endoftext|>").save_pretrained(directory)
    config = GPT2Config(vocab_size=1024, n_positions=32, n_embd=32, n_layer=1, n_head=2, bos_token_id=0,
                        eos_token_id=0)  # fmt: skip
    GPT2LMHeadModel(config).save_pretrained(directory)
    return directory


def test_one_token_tokenizer_for_1024_rows_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hf = _one_token_gpt2(tmp_path / "hf")
    ck = tmp_path / "ck"
    line = _fails(capsys, convert_main, ["from-hf", "--load", str(hf), "--save", str(ck)])
    assert "1 tokens" in line and "1024 vocabulary rows" in line and "--force-tokenizer" in line
    assert not ck.exists()
    assert convert_main(["from-hf", "--load", str(hf), "--save", str(ck), "--force-tokenizer"]) == 0
    capsys.readouterr()
    assert convert_main(["inspect", str(ck), "--json"]) == 1  # inconsistent
    record = json.loads(capsys.readouterr().out)
    assert not record["ok"] and any("too few" in p for p in record["problems"])
    line = _fails(capsys, generate_main, ["--ckpt", str(ck), "--prompt", "hi", "--max-new-tokens", "2"])
    assert "1 tokens" in line and "1024" in line
