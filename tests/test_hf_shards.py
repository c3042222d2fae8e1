"""Streaming HF export: sharded safetensors like ``save_pretrained``, loadable by transformers, exact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pretrain.checkpoint.plan import ModelSpec
from pretrain.models.families.gpt2 import canonical_to_hf
from pretrain.utils.errors import UserError
from tests.gpt_fixtures import full_weights, tiny_config
from tools.convert_cli import main as convert_main
from tools.hf_io import export_hf
from tools.hf_plan import layer_groups
from tools.hf_shards import ShardWriter, parse_shard_size


def _export(tmp_path: Path, max_shard_size: str) -> tuple[Path, dict[str, torch.Tensor]]:
    cfg = tiny_config(num_layers=3)
    full = full_weights(cfg)
    out = export_hf(
        full.items(), ModelSpec(kind="gpt", cfg=cfg), tmp_path / "hf", max_shard_size=max_shard_size
    )
    return out, canonical_to_hf(full, cfg)


def test_sharded_export_matches_save_pretrained_layout_and_loads(tmp_path: Path) -> None:
    from transformers import GPT2LMHeadModel

    out, want = _export(tmp_path, "40KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted({*index["weight_map"].values()})
    assert len(shards) > 2 and shards == [
        f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)
    ]
    assert not (out / "model.safetensors").exists()
    got: dict[str, torch.Tensor] = {}
    for shard in shards:
        part = load_file(str(out / shard))
        assert sum(t.numel() * t.element_size() for t in part.values()) <= 40_000 or len(part) == 1
        got.update(part)
    assert set(got) == set(want) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in want.values())
    for name, t in want.items():
        assert torch.equal(got[name], t), name
    hf = GPT2LMHeadModel.from_pretrained(str(out))  # transformers reads the index and shards
    torch.testing.assert_close(
        hf.transformer.h[2].attn.c_attn.weight.detach(), want["transformer.h.2.attn.c_attn.weight"]
    )


def test_one_shard_is_model_safetensors_without_index(tmp_path: Path) -> None:
    out, want = _export(tmp_path, "5GB")
    assert not (out / "model.safetensors.index.json").exists()
    got = load_file(str(out / "model.safetensors"))
    assert set(got) == set(want) and all(torch.equal(got[k], v) for k, v in want.items())


def test_bf16_and_scalar_tensors_round_trip(tmp_path: Path) -> None:
    writer = ShardWriter(tmp_path, max_shard_size=10)
    tensors = {
        "a": torch.randn(3, 4).bfloat16(),
        "b": torch.tensor(2.5),
        "c": torch.zeros(0),
        "d": torch.arange(5),
    }
    for k, v in tensors.items():
        writer.add(k, v)
    files = writer.close()
    got = {k: v for f in files for k, v in load_file(str(f)).items()}
    assert all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in tensors.items())


def test_shard_sizes_parse_like_save_pretrained() -> None:
    assert parse_shard_size("5GB") == 5 * 10**9
    assert parse_shard_size("500MB") == 500 * 10**6
    assert parse_shard_size("2GiB") == 2 * 2**30
    assert parse_shard_size("100kb") == 100_000
    assert parse_shard_size(1234) == 1234
    for bad in ("big", "5XB", "0"):
        with pytest.raises(UserError, match="--max-shard-size"):
            parse_shard_size(bad)


def test_layer_groups_keep_layers_together() -> None:
    names = ["emb", "x.layers.1.w", "x.layers.0.w", "x.layers.10.b", "x.layers.1.b", "final"]
    assert layer_groups(names) == [
        ["x.layers.0.w"],
        ["x.layers.1.w", "x.layers.1.b"],
        ["x.layers.10.b"],
        ["emb", "final"],
    ]


def test_cli_bad_shard_size_is_one_line(trained_gpt: dict[str, str], tmp_path: Path, capsys) -> None:
    argv = [
        "to-hf",
        "--load",
        trained_gpt["ckpt"],
        "--save",
        str(tmp_path / "hf"),
        "--max-shard-size",
        "lots",
    ]
    with pytest.raises(SystemExit) as exit_info:
        convert_main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and "--max-shard-size lots" in err[0]
    assert not (tmp_path / "hf").exists()


def test_progress_is_told_the_total_and_every_written_tensor(tmp_path: Path) -> None:
    cfg = tiny_config(num_layers=2)
    full = full_weights(cfg)
    totals: list[int] = []
    written: list[str] = []

    def start(total: int):  # type: ignore[no-untyped-def]
        totals.append(total)
        return written.append

    out = export_hf(full.items(), ModelSpec(kind="gpt", cfg=cfg), tmp_path / "hf", progress=start)
    on_disk = set(load_file(str(out / "model.safetensors")))
    assert totals == [len(on_disk)] and sorted(written) == sorted(on_disk)
