"""``mlm-finetune sft --eval-only``: valid_loss equals transformers' own (its assistant mask, mean
NLL) in one process and at tp2 pp2; packed equals unpacked, and no attention crosses a sample."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from finetune.cli import main
from finetune.sft.tiny_tokenizer import CHAT_TEMPLATE_FILE, SFT_CHAT_FILE
from tests.sft_fixtures import chat_messages, hf_reference_loss, make_chat_llama

REL = 1e-6


@pytest.fixture(scope="module")
def chat_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_chat_llama(tmp_path_factory.mktemp("chat_llama"))


@pytest.fixture(scope="module")
def reference(chat_llama: Path) -> tuple[float, int]:
    return hf_reference_loss(chat_llama, chat_messages(SFT_CHAT_FILE))


def _eval(model: Path, out: Path, *extra: str) -> dict:
    assert main(["sft", "--hf-model", str(model), "--data", str(SFT_CHAT_FILE), "--eval-only", "--seq-length", "128",
                 "--results-dir", str(out), *extra]) == 0  # fmt: skip
    return json.loads((out / "results.json").read_text())


def test_valid_loss_equals_transformers(
    chat_llama: Path, reference: tuple[float, int], tmp_path: Path
) -> None:
    rec = _eval(chat_llama, tmp_path / "plain", "--micro-batch-size", "3", "--global-batch-size", "3")
    assert rec["task"] == "sft" and rec["details"]["lora"] is None and rec["details"]["dtype"] == "float32"
    assert rec["metrics"]["valid_loss_tokens"] == reference[1]
    assert abs(rec["metrics"]["valid_loss"] - reference[0]) <= REL * reference[0]
    packed = _eval(chat_llama, tmp_path / "packed", "--pack")
    assert abs(packed["metrics"]["valid_loss"] - reference[0]) <= REL * reference[0]
    assert packed["metrics"]["valid_loss_tokens"] == reference[1]
    # the same template without generation markers: the prefix-diffed mask gives the same loss
    unmarked = tmp_path / "unmarked.jinja"
    unmarked.write_text(
        CHAT_TEMPLATE_FILE.read_text().replace("{%- generation -%}", "").replace("{%- endgeneration -%}", "")
    )
    diffed = _eval(chat_llama, tmp_path / "diffed", "--chat-template", str(unmarked))
    assert diffed["metrics"]["valid_loss_tokens"] == reference[1]
    assert abs(diffed["metrics"]["valid_loss"] - reference[0]) <= REL * reference[0]
    assert diffed["details"]["template_sha256"] != rec["details"]["template_sha256"]


def _gpt(model_dir: Path) -> torch.nn.Module:
    from pretrain.models.gpt import GPTModel
    from pretrain.models.sharding import load_full_state_dict
    from pretrain.parallel.state import ParallelState
    from tools.hf_io import import_hf

    src = import_hf(model_dir)
    model = GPTModel(src.spec.cfg, ParallelState.single())
    load_full_state_dict(model, {n: src.tensor(n) for n in src.names()})
    return model.eval()


def test_packed_losses_equal_unpacked_and_no_attention_crosses(chat_llama: Path) -> None:
    from finetune.sft.masks import ChatRenderer
    from finetune.sft.packing import pack_rows, pad_rows
    from finetune.sft.records import read_records
    from finetune.sft.samples import encode_records
    from finetune.sft.source import hf_tokenizer, load_decoder
    from finetune.sft.task import sft_forward_step
    from finetune.sft.template import chat_template

    dec = load_decoder(ckpt=None, hf_model=str(chat_llama))
    hf = hf_tokenizer(dec.tokenizer)
    renderer = ChatRenderer(hf, chat_template(hf, None, tokenizer_source="t"))
    samples = encode_records(read_records(SFT_CHAT_FILE, flag="--data")[:8], tokenizer=dec.tokenizer, renderer=renderer,
                             loss_on="assistant", seq_length=128, flag="--data").samples  # fmt: skip
    model = _gpt(chat_llama)
    padded, packed = pad_rows(samples, 128, 0), pack_rows(samples, 128, 0)
    assert len(packed["tokens"]) < len(samples)  # several samples per row
    with torch.no_grad():
        unpacked_losses = sft_forward_step(model, padded, None, True)
        packed_losses = sft_forward_step(model, packed, None, True)
    lengths = torch.tensor([len(s.ids) - 1 for s in samples])
    keep = torch.arange(128)[None] < lengths[:, None]
    torch.testing.assert_close(
        packed_losses[packed["segments"] >= 0], unpacked_losses[keep], rtol=1e-5, atol=1e-5
    )
    # probe: change every token of the first sample of row 0; the row's other samples do not move at all
    probe = {k: v.clone() for k, v in packed.items()}
    first = probe["segments"][0] == 0
    probe["tokens"][0, first] = (probe["tokens"][0, first] + 7) % 300
    with torch.no_grad():
        moved = sft_forward_step(model, probe, None, True)
    rest = packed["segments"][0] > 0
    assert rest.any() and torch.equal(moved[0, rest], packed_losses[0, rest])
    assert not torch.equal(moved[0, first], packed_losses[0, first])


@pytest.mark.slow
def test_valid_loss_at_tp2_pp2_equals_transformers(
    chat_llama: Path, reference: tuple[float, int], tmp_path: Path
) -> None:
    from tests.distributed import launch

    out = tmp_path / "tp2pp2"
    proc = launch(4, "finetune.cli", ["sft", "--hf-model", str(chat_llama), "--data", str(SFT_CHAT_FILE), "--eval-only",
                                        "--seq-length", "128", "--tp", "2", "--pp", "2", "--results-dir", str(out)])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = json.loads((out / "results.json").read_text())
    assert rec["details"]["layout"] == "tp2-pp2-dp1" and rec["metrics"]["valid_loss_tokens"] == reference[1]
    assert abs(rec["metrics"]["valid_loss"] - reference[0]) <= REL * reference[0]
