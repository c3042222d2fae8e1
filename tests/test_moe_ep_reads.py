"""An expert-parallel evaluation rank reads only its own experts (``ExpertShare``).

A tiny random Qwen2-MoE (6 experts) converted with ``from-hf``: as legacy files per EP rank
(``--ep 2``: ``mp_rank_00_000``/``mp_rank_00_001``), as ``torch_dist``, and as one legacy file per
TP rank (EP 1). Read for EP rank ``r`` of 2, each keeps exactly experts ``3r .. 3r+2`` of every MoE
layer; the legacy reader materialises tensors only from the file holding them (the first rank file
is opened for ``args`` alone), ``torch_dist`` reads no region of another rank's expert; every
other tensor equals the whole read, and the ranks' digests together give the whole checkpoint's
weights fingerprint. The parameter count is the whole model's.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from mlm_eval.scoring.megatron import read_gpt_checkpoint
from pretrain.checkpoint.expert_layout import ExpertShare, expert_index
from pretrain.checkpoint.fingerprint import combine_digests
from pretrain.checkpoint.legacy import expert_files, reader
from pretrain.checkpoint.torch_dist.reader import TorchDistReader
from tests.llama_fixtures import qwen_style_bpe_tokenizer
from tests.moe_hf_fixtures import hf_model
from tools.convert_cli import main as convert_main

pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
LAYOUTS = {"legacy-ep2": ["--ep", "2"], "torch_dist": ["--ckpt-format", "torch_dist"], "legacy-ep1": []}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("epreads")
    tok = qwen_style_bpe_tokenizer()
    model = hf_model("qwen2_moe", vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                     pad_token_id=tok.pad_token_id, max_position_embeddings=256)  # fmt: skip
    model.save_pretrained(root / "hf")
    tok.save_pretrained(root / "hf")
    out = {}
    for name, flags in LAYOUTS.items():
        assert convert_main(["from-hf", "--load", str(root / "hf"), "--save", str(root / name), *flags]) == 0
        out[name] = root / name
    return out


def _experts(full: dict[str, torch.Tensor]) -> set[int]:
    return {e for n in full if (e := expert_index(n)) is not None}


def _spy_legacy(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    """Record the rank files loaded and those whose tensors are materialised."""
    seen: dict[str, list[str]] = {"loaded": [], "read": []}
    for module in (reader, expert_files):
        real = module.load_untrusted

        def load(path: Any, *a: Any, real: Any = real, **k: Any) -> Any:
            seen["loaded"].append(Path(path).parent.name)
            return real(path, *a, **k)

        monkeypatch.setattr(module, "load_untrusted", load)
    real_part = reader.LegacyReader._part

    def part(self: reader.LegacyReader, ref: tuple[int, str, str]) -> torch.Tensor:
        t = real_part(self, ref)
        owner = [f for f, flat in zip(self.files, self.flats, strict=True) if flat[ref[1]].get(ref[2]) is t]
        seen["read"] += [f.parent.name for f in owner]
        return t

    monkeypatch.setattr(reader.LegacyReader, "_part", part)
    return seen


def test_legacy_ep_rank_reads_only_its_file(ckpts: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    whole = read_gpt_checkpoint(str(ckpts["legacy-ep2"]))
    seen = _spy_legacy(monkeypatch)
    parts = []
    for rank in (0, 1):
        seen["loaded"].clear()
        seen["read"].clear()
        got = read_gpt_checkpoint(str(ckpts["legacy-ep2"]), experts=ExpertShare(rank=rank, size=2))
        assert _experts(got.full) == set(range(3 * rank, 3 * rank + 3))
        own = f"mp_rank_00_00{rank}"
        assert set(seen["read"]) == {own}, seen["read"]  # tensors only from its own file
        assert set(seen["loaded"]) <= {"mp_rank_00_000", own}  # the first file gives args
        assert seen["loaded"].count(own) == 1
        for name, t in got.full.items():
            assert torch.equal(t, whole.full[name]), name
        assert got.info["parameters"] == whole.info["parameters"]
        assert got.info["fingerprint"] is None
        parts.append(got.digests)
    assert combine_digests({**parts[0], **parts[1]}) == whole.info["fingerprint"]
    assert set(parts[0]) | set(parts[1]) == set(whole.full)


@pytest.mark.parametrize("layout", ["torch_dist", "legacy-ep1"])
def test_share_reads_only_its_experts(
    ckpts: dict[str, Path], layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    whole = read_gpt_checkpoint(str(ckpts[layout]))
    read_names: list[str] = []
    real = TorchDistReader.stored_rows

    def stored_rows(self: TorchDistReader, name: str) -> torch.Tensor:
        read_names.append(name)
        return real(self, name)

    monkeypatch.setattr(TorchDistReader, "stored_rows", stored_rows)
    for rank in (0, 1):
        read_names.clear()
        got = read_gpt_checkpoint(str(ckpts[layout]), experts=ExpertShare(rank=rank, size=2))
        assert _experts(got.full) == set(range(3 * rank, 3 * rank + 3))
        if layout == "torch_dist":
            assert {expert_index(n) for n in read_names} - {None} == set(range(3 * rank, 3 * rank + 3))
        assert set(got.full) == {
            n for n in whole.full if expert_index(n) in (None, *range(3 * rank, 3 * rank + 3))
        }
        assert got.info["parameters"] == whole.info["parameters"]


def test_share_refuses_experts_not_divisible(ckpts: dict[str, Path]) -> None:
    from pretrain.utils.errors import UserError

    with pytest.raises(UserError, match="--num-experts 6 is not divisible by --expert-model-parallel-size 4"):
        read_gpt_checkpoint(str(ckpts["legacy-ep2"]), experts=ExpertShare(rank=0, size=4))
