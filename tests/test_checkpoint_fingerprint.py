"""The weights fingerprint: one string per set of weights, whatever the layout, format or storage dtype."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from pretrain.checkpoint.fingerprint import (
    fingerprint_tensors,
    is_fingerprint,
    scheme_of,
    short_fingerprint,
    weights_fingerprint,
)
from pretrain.checkpoint.legacy.writer import DictSource, write_layout
from pretrain.checkpoint.opener import open_checkpoint
from pretrain.checkpoint.plan import ModelSpec
from pretrain.parallel.config import ParallelConfig
from pretrain.utils.errors import UserError
from tests.convert_fixtures import write_ours
from tests.gpt_fixtures import full_weights, tiny_config
from tools.convert_cli import main as convert_main
from tools.hf_io import import_hf

os.environ["HF_HUB_OFFLINE"] = "1"
CFG = tiny_config(num_layers=4)


@pytest.fixture(scope="module")
def full() -> dict[str, torch.Tensor]:
    return full_weights(CFG)


def test_layouts_reshard_and_hf_export_share_one_fingerprint(tmp_path: Path, full) -> None:
    expected = weights_fingerprint(full)
    assert is_fingerprint(expected) and expected.startswith("w2:")
    src = write_ours(tmp_path / "tp2pp2", CFG, full, tp=2, pp=2)
    assert convert_main(["reshard", "--load", str(src), "--save", str(tmp_path / "tp1"),
                         "--target-tp", "1", "--target-pp", "1"]) == 0  # fmt: skip
    assert convert_main(["to-hf", "--weights-only", "--load", str(src), "--save", str(tmp_path / "hf")]) == 0
    two, one = open_checkpoint(src), open_checkpoint(tmp_path / "tp1")
    assert (two.info.tp, two.info.pp, one.info.tp) == (2, 2, 1)  # padded to 1024 rows on disk
    assert weights_fingerprint(two) == weights_fingerprint(one) == expected
    assert weights_fingerprint(import_hf(tmp_path / "hf")) == expected


def test_storage_dtype_and_padding_rows_do_not_count_but_values_do(full) -> None:
    expected = fingerprint_tensors(full.items())
    half = {k: v.half() for k, v in full.items()}
    # fp16 values widen exactly: the same numbers stored in fp16 or fp32 are the same weights.
    assert weights_fingerprint({k: v.float() for k, v in half.items()}) == weights_fingerprint(half)
    # bf16 numbers too, and w2 hashes them narrowed whatever they are stored in: bf16, fp32, fp16
    small = {k: (v * 64).round() / 64 for k, v in full.items()}  # fp16 and bf16 hold these exactly
    stored = [{k: v.to(d) for k, v in small.items()} for d in (torch.bfloat16, torch.float32, torch.float16)]
    assert len({weights_fingerprint(s) for s in stored}) == 1
    assert len({weights_fingerprint(s, scheme="w1") for s in stored}) == 1
    assert weights_fingerprint(stored[0]) != weights_fingerprint(stored[0], scheme="w1")
    # Rounding to bf16 changes the weights, and so the fingerprint.
    assert weights_fingerprint({k: v.bfloat16() for k, v in full.items()}) != expected
    padded = dict(full)
    emb = "language_model.embedding.word_embeddings.weight"
    padded[emb] = torch.cat([full[emb], torch.randn(21, CFG.hidden_size)])
    assert fingerprint_tensors(padded.items(), vocab_size=CFG.vocab_size) == expected
    assert fingerprint_tensors(reversed(list(full.items()))) == expected  # any order
    nudged = dict(full)
    first = next(iter(full))
    nudged[first] = full[first].clone()
    nudged[first].view(-1)[0] = torch.nextafter(full[first].view(-1)[0], torch.tensor(1.0))
    assert fingerprint_tensors(nudged.items()) != expected  # one ulp in one value
    renamed = {("x." + k if k == first else k): v for k, v in full.items()}
    assert fingerprint_tensors(renamed.items()) != expected
    reshaped = dict(full)
    reshaped[emb] = full[emb].reshape(CFG.hidden_size, CFG.vocab_size)
    assert fingerprint_tensors(reshaped.items()) != expected


def test_fresh_heads_are_left_out_and_bad_input_is_named(full) -> None:
    spec = ModelSpec(kind="gpt", cfg=CFG, fresh_heads=("extra_head",))
    with_head = {**full, "extra_head.weight": torch.randn(2, 2)}
    assert weights_fingerprint(DictSource(spec, with_head)) == weights_fingerprint(full)
    with pytest.raises(UserError, match="language_model.embedding.word_embeddings.weight: 1003 vocabulary"):
        fingerprint_tensors(full.items(), vocab_size=2000)
    with pytest.raises(UserError, match="given twice"):
        fingerprint_tensors([("a", torch.ones(1)), ("a", torch.ones(1))])
    fp = weights_fingerprint(full)
    assert short_fingerprint(fp) == fp[:15] and len(short_fingerprint(fp)) == 15
    assert not is_fingerprint("w1:xyz") and not is_fingerprint(None) and not is_fingerprint("w9:" + "0" * 64)
    assert is_fingerprint("w1:" + "0" * 64) and scheme_of("w1:" + "0" * 64) == "w1" and scheme_of(fp) == "w2"


@pytest.mark.parametrize("case", ["gpt2", "llama3", "mistral"])
def test_loaded_hf_model_matches_its_megatron_checkpoint(tmp_path: Path, case: str) -> None:
    """What ``mlm-eval --hf-model`` hashes (the loaded HF model) equals the hash of the checkpoint
    ``from-hf --tp 2 --pp 2`` makes of the same directory."""
    from pretrain.checkpoint.fingerprint import hf_weights_fingerprint

    if case == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=301, n_positions=32, n_embd=32, n_layer=2, n_head=4))
    else:
        from tests.llama_fixtures import hf_model

        model = hf_model(case)
    model.save_pretrained(str(tmp_path / "hf"))
    write_layout(import_hf(tmp_path / "hf"), tmp_path / "ck", ParallelConfig(tp=2, pp=2))  # as from-hf does
    expected = weights_fingerprint(open_checkpoint(tmp_path / "ck"))
    assert hf_weights_fingerprint(model.state_dict(), model.config) == expected
    assert (
        hf_weights_fingerprint({"x": torch.ones(2)}, model.config) != expected
    )  # not a valid model: raw hash


def test_reshard_and_from_hf_record_the_fingerprint_and_inspect_shows_it(
    tmp_path: Path, full, capsys
) -> None:
    import json

    expected = weights_fingerprint(full)
    src = write_ours(tmp_path / "tp2", CFG, full, tp=2, pp=1)
    assert convert_main(["reshard", "--load", str(src), "--save", str(tmp_path / "tp1"),
                         "--target-tp", "1", "--target-pp", "2"]) == 0  # fmt: skip
    meta = open_checkpoint(tmp_path / "tp1").metadata
    assert meta is not None and meta.provenance.weights_fingerprint == expected
    assert convert_main(["reshard", "--load", str(tmp_path / "tp1"), "--save", str(tmp_path / "again"),
                         "--target-tp", "2", "--target-pp", "1"]) == 0  # fmt: skip
    again = open_checkpoint(tmp_path / "again").metadata
    assert again is not None and again.provenance.weights_fingerprint == expected  # carried, still equal
    capsys.readouterr()
    assert convert_main(["inspect", str(tmp_path / "again"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["provenance"]["weights_fingerprint"] == expected
    assert convert_main(["inspect", str(tmp_path / "again")]) == 0
    assert short_fingerprint(expected) in capsys.readouterr().out
    assert convert_main(["to-hf", "--weights-only", "--load", str(src), "--save", str(tmp_path / "hf")]) == 0
    assert convert_main(["from-hf", "--weights-only", "--load", str(tmp_path / "hf"),
                         "--save", str(tmp_path / "back")]) == 0  # fmt: skip
    back = open_checkpoint(tmp_path / "back").metadata
    assert back is not None and back.provenance.weights_fingerprint == expected


def test_pretrain_records_the_data_hash_of_its_idx_files(trained_gpt: dict[str, str], tmp_path: Path) -> None:
    from pretrain.data.gpt_dataset import data_hash

    meta = open_checkpoint(trained_gpt["ckpt"]).metadata
    assert meta is not None and meta.provenance.data_hash == data_hash([(trained_gpt["data"], None)])
    assert meta.provenance.data_hash is not None and meta.provenance.data_hash.startswith("idx-b2:")
    other = tmp_path / "other"
    idx = Path(trained_gpt["data"] + ".idx").read_bytes()
    (tmp_path / "other.idx").write_bytes(idx[:-8] + bytes(8))  # other document sizes, other data
    assert data_hash([(str(other), None)]) != meta.provenance.data_hash
    assert data_hash([(trained_gpt["data"], 0.5)]) != meta.provenance.data_hash  # weights count
