"""Conversion writers stream (issue 29 part 1): the bytes of the old writers, every byte written once,
memory flat in the output file's size.

* Rank files: :func:`stream_save` writes ``torch.save``'s bytes while making one tensor at a time.
* Safetensors: the header is planned from dtypes and shapes, so the data is written once, straight
  into the shard (no temporary data file copied after the header), and the files are the bytes of
  the unplanned writer, which ``safetensors`` reads back.
* Readers tell a tensor's dtype and shape without reading it.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from pretrain.checkpoint.legacy.stream_save import LazyTensor, stream_save
from pretrain.checkpoint.opener import open_checkpoint
from pretrain.checkpoint.plan import ModelSpec
from pretrain.checkpoint.tensor_meta import meta_like, tensor_meta
from tests.convert_fixtures import write_ours
from tests.gpt_fixtures import full_weights, tiny_config
from tools.convert_cli import main

os.environ["HF_HUB_OFFLINE"] = "1"
LLAMA = dict(normalization="RMSNorm", swiglu=True, position_embedding_type="rope", add_bias_linear=False,
             num_query_groups=2, untie_embeddings_and_output_weights=True)  # fmt: skip


def _lazy(t: torch.Tensor, made: list[str], name: str) -> LazyTensor:
    def make() -> torch.Tensor:
        made.append(name)
        return t.clone()

    return LazyTensor(t.dtype, tuple(t.shape), make)


def test_stream_save_writes_torch_save_bytes_making_tensors_in_file_order() -> None:
    gen = torch.Generator().manual_seed(0)
    model = {
        "embedding.weight": torch.randn(11, 4, generator=gen).bfloat16(),
        "layers.0.weight": torch.randn(4, 4, generator=gen),
        "layers.0.bias": torch.zeros(0),
        "counts": torch.arange(5),
        "flag": torch.tensor([True, False]),
        "_extra_state": None,
    }
    shared = torch.ones(3)
    state = {"iteration": 3, "checkpoint_version": 3.0, "args": {"s": "cpu", "n": [1, 2]}, "model": model,
             "optimizer": {"a": shared, "b": shared, "step": 7}, "rng_state": [{"t": torch.get_rng_state()}]}  # fmt: skip
    want = io.BytesIO()
    torch.save(state, want)
    made: list[str] = []
    lazy_model = {k: _lazy(v, made, k) if isinstance(v, torch.Tensor) else v for k, v in model.items()}
    got = io.BytesIO()
    stream_save({**state, "model": lazy_model}, got)
    assert got.getvalue() == want.getvalue()
    assert made == [k for k, v in model.items() if isinstance(v, torch.Tensor)]
    got.seek(0)
    back = torch.load(got, weights_only=True)
    assert all(torch.equal(back["model"][k], v) for k, v in model.items() if isinstance(v, torch.Tensor))
    assert back["optimizer"]["a"] is back["optimizer"]["b"]


def test_stream_save_writes_a_view_of_a_larger_storage_as_itself(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """Written from a slice of its storage: no copy of the view first, no deprecated pointer call."""
    base = torch.arange(100, dtype=torch.float32)
    view = base[10:30].view(4, 5)  # e.g. a TP shard that is a slice of a mapped full tensor
    want, got = io.BytesIO(), io.BytesIO()
    torch.save({"w": view.clone()}, want)
    capfd.readouterr()
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "clone", lambda *a, **k: pytest.fail("the view was copied"))
        stream_save({"w": LazyTensor(torch.float32, (4, 5), lambda: view)}, got)
    assert got.getvalue() == want.getvalue()
    assert "deprecated" not in capfd.readouterr().err


def test_stream_save_refuses_a_tensor_unlike_its_announcement() -> None:
    with pytest.raises(RuntimeError, match="announced as torch.float32"):
        stream_save({"w": LazyTensor(torch.float32, (2,), lambda: torch.zeros(3))}, io.BytesIO())


def _export(tmp_path: Path, name: str, ck: Path, shard: str) -> Path:
    argv = ["to-hf", "--weights-only", "--no-verify", "--vocab-size", "1003", "--load", str(ck),
            "--save", str(tmp_path / name), "--max-shard-size", shard]  # fmt: skip
    assert main(argv) == 0
    return tmp_path / name


@pytest.mark.parametrize("overrides", [{}, LLAMA], ids=["gpt2", "llama"])
def test_planned_safetensors_are_the_unplanned_bytes_written_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overrides: dict[str, object]
) -> None:
    """The data goes straight into each shard after its planned header (no temporary data file
    copied in afterwards, as before), and the files are byte for byte the unplanned writer's."""
    from safetensors.torch import load_file

    import tools.hf_plan as hp
    import tools.hf_shards as hs

    cfg = tiny_config(num_layers=3, **overrides)  # type: ignore[arg-type]
    ck = write_ours(tmp_path / "ck", cfg, full_weights(cfg), tp=2, pp=1)
    copies: list[int] = []
    real_copy = hs._copy
    monkeypatch.setattr(hs, "_copy", lambda src, dst, n: (copies.append(n), real_copy(src, dst, n)))
    for shard in ("5GB", "20KB"):
        planned = _export(tmp_path, f"planned_{shard}", ck, shard)
        assert copies == [], "every byte written once"
        with monkeypatch.context() as m:
            m.setattr(
                hp, "plan_hf_tensors", lambda *a: None
            )  # the writer as it was: data, then header + copy
            unplanned = _export(tmp_path, f"unplanned_{shard}", ck, shard)
        assert copies
        copies.clear()
        files = sorted(p.name for p in planned.iterdir())
        assert files == sorted(p.name for p in unplanned.iterdir())
        assert (shard == "20KB") == ("model.safetensors.index.json" in files)
        for f in files:
            assert (planned / f).read_bytes() == (unplanned / f).read_bytes(), f
            if f.endswith(".safetensors"):
                a, b = load_file(str(planned / f)), load_file(str(unplanned / f))
                assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_writer_departing_from_its_plan_still_writes_correct_files(tmp_path: Path) -> None:
    """An ``add`` the plan did not announce (a tensor dropped, reshaped or added) rewrites that
    shard's header: the files hold exactly what was added."""
    from safetensors.torch import load_file

    from tools.hf_shards import Planned, ShardWriter

    tensors = {f"t{i}": torch.full((i + 1, 3), float(i)) for i in range(6)}
    plan = [Planned(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()]
    added = dict(tensors)
    del added["t1"]
    added["t4"] = torch.ones(2, 2)
    added["extra"] = torch.zeros(1)
    writer = ShardWriter(tmp_path, max_shard_size=100, plan=plan)
    for k, v in added.items():
        writer.add(k, v)
    got = {k: v for f in writer.close() for k, v in load_file(str(f)).items()}
    assert got.keys() == added.keys() and all(torch.equal(got[k], v) for k, v in added.items())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize(("fmt", "tp"), [("torch", 2), ("torch", 4), ("torch_dist", 2)])
def test_readers_tell_dtype_and_shape_without_reading(tmp_path: Path, fmt: str, tp: int) -> None:
    """tp 4 over 2 query groups: key/value heads replicated on two ranks each."""
    cfg = tiny_config(num_layers=2, **LLAMA)  # type: ignore[arg-type]
    full = {k: v.bfloat16() if "layers.1" in k else v for k, v in full_weights(cfg).items()}
    ck = write_ours(tmp_path / "ck", cfg, full, tp=tp, pp=2)
    if fmt == "torch_dist":
        argv = ["reshard", "--load", str(ck), "--save", str(tmp_path / "td"), "--target-tp", "1",
                "--target-pp", "1", "--ckpt-format", "torch_dist"]  # fmt: skip
        assert main(argv) == 0
        ck = tmp_path / "td"
    reader = open_checkpoint(ck)
    reader.tensor = None  # type: ignore[method-assign,assignment]  # tensor_meta must not read
    metas = {n: reader.tensor_meta(n) for n in reader.names()}  # type: ignore[attr-defined]
    del reader.tensor
    for n in reader.names():
        want = meta_like(reader.tensor(n))
        assert (metas[n].shape, metas[n].dtype) == (want.shape, want.dtype), n
        got = tensor_meta(reader, n)
        assert (got.shape, got.dtype) == (want.shape, want.dtype), n


def test_a_lazy_source_tells_dtype_and_shape_on_fake_tensors() -> None:
    from pretrain.checkpoint.types import LazySource

    calls: list[str] = []
    base = torch.randn(6, 4)

    def make() -> torch.Tensor:
        calls.append("made")
        return torch.cat([base, base]).t().to(torch.bfloat16)

    src = LazySource(ModelSpec(kind="gpt", cfg=tiny_config()), {"w": make})
    meta = tensor_meta(src, "w")
    assert (meta.device.type, meta.shape, meta.dtype) == ("meta", (4, 12), torch.bfloat16)
    assert calls == ["made"]  # run once, on fake tensors: no real tensor was built


_MEMORY_SCRIPT = textwrap.dedent(
    """
    import sys
    from benchmarks.anon_memory import run_measured
    cmd = [sys.executable, "-m", "tools.convert_cli", *sys.argv[1:]]
    m = run_measured(cmd)
    assert m.returncode == 0, m.output
    print(m.peak_anon_bytes)
    """
)


def _peak_anon(tmp_path: Path, argv: list[str]) -> int:
    script = tmp_path / "mem.py"
    script.write_text(_MEMORY_SCRIPT)
    root = Path(__file__).parents[1]  # benchmarks/ is not installed: the script imports it from here
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
    }
    out = subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True, check=True,
                         cwd=root, env=env)  # fmt: skip
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # four conversions of a 100 MB model, each a fresh process
def test_peak_memory_is_flat_in_output_file_size(tmp_path: Path) -> None:
    """A 100 MB model whose largest tensor is 1 MB: reshard into one rank file (the whole model)
    and to-hf with one shard or many each grow the process tree's anonymous memory by a few
    tensors over the interpreter's, not by the file (the old rank-file writer held the file)."""
    cfg = tiny_config(num_layers=32, hidden_size=256, num_attention_heads=8, max_position_embeddings=64)
    full = full_weights(cfg)
    model_bytes = sum(t.numel() * 4 for t in full.values())
    largest = max(t.numel() * 4 for t in full.values())
    ck = write_ours(tmp_path / "ck", cfg, full, tp=2, pp=2)
    del full
    base = _peak_anon(tmp_path, ["inspect", str(ck)])  # the interpreter, torch, opening the checkpoint
    one_file = _peak_anon(tmp_path, ["reshard", "--load", str(ck), "--save", str(tmp_path / "r"),
                                     "--target-tp", "1", "--target-pp", "1"])  # fmt: skip
    hf = ["to-hf", "--weights-only", "--no-verify", "--vocab-size", "1003", "--load", str(ck)]
    one_shard = _peak_anon(tmp_path, [*hf, "--save", str(tmp_path / "a"), "--max-shard-size", "5GB"])
    many = _peak_anon(tmp_path, [*hf, "--save", str(tmp_path / "b"), "--max-shard-size", "10MB"])
    print(base, one_file, one_shard, many, model_bytes, largest)
    assert model_bytes > 100e6 and largest < 2e6
    assert one_file - base < 4 * largest + 30e6, (one_file, base, model_bytes)
    # to-hf's forked child (tools/forked_job.py: transformers' config and tokenizer files) holds
    # its import beside the writer, and the pages either process touches after the fork are
    # counted in both: about 21 MB more than the thread it replaced, the same for any model size;
    # with torch's objects frozen (pretrain.utils.console.import_torch_frozen) the child shares
    # ~15 MB fewer pages with the writer (Pss_Anon 142 -> 157 MB here), again for any model size
    for peak in (one_shard, many):
        assert peak - base < 4 * largest + 75e6, (peak, base, model_bytes)
    assert abs(one_shard - many) < 2 * largest + 20e6, (one_shard, many)


@pytest.mark.slow  # about 50 s: tiny models, ten conversions as processes
def test_bench_convert_scale_quick_smoke(tmp_path: Path) -> None:
    import json

    out = subprocess.run([sys.executable, "-m", "benchmarks.bench_convert_scale", "--quick", "--workdir",
                          str(tmp_path), "--plot", str(tmp_path / "curve.svg")], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).parents[1])  # fmt: skip
    rec = json.loads(out.stdout.strip().splitlines()[-1])
    assert [p["size"] for p in rec["sizes"]] == ["tiny", "small"]
    for p in rec["sizes"]:
        for conv in ("to_hf", "reshard", "from_hf", "to_torch_dist", "torch_dist_to_hf"):
            assert {"mb_per_s", "time_over_cp", "peak_anon_gb"} <= set(p[conv])
        assert p["largest_tensor_gb"] > 0
    assert set(rec["anon_slope_gb_per_b_params"]) >= {"to_hf", "reshard"}
    assert (tmp_path / "curve.svg").read_text().startswith("<svg")
    assert [p.name for p in tmp_path.iterdir()] == ["curve.svg"]  # generated checkpoints removed


@pytest.mark.parametrize("overrides", [{}, LLAMA], ids=["gpt2", "llama"])
def test_to_hf_converts_one_canonical_tensor_at_a_time(tmp_path: Path, overrides: dict[str, object]) -> None:
    """Every HF tensor comes from one canonical tensor, so a layer is never whole in memory: the
    plan names each output's source, and the stream reads each canonical tensor once."""
    from tools.hf_io import export_family_of
    from tools.hf_plan import _one_source_each, plan_hf_tensors, stream_hf_tensors

    cfg = tiny_config(num_layers=2, **overrides)  # type: ignore[arg-type]
    reader = open_checkpoint(write_ours(tmp_path / "ck", cfg, full_weights(cfg), tp=2, pp=1), vocab_size=1003)
    fam = export_family_of(reader.spec).module()

    def convert(chunk: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return fam.export_tensors(chunk, reader.spec.cfg, fresh_heads=reader.spec.fresh_heads)

    names = reader.names()
    metas = {n: tensor_meta(reader, n) for n in names}
    plan = plan_hf_tensors(names, metas, convert)
    assert plan is not None and all(_one_source_each(g) for g in plan.groups)
    reads: list[str] = []
    got = list(stream_hf_tensors(names, lambda n: reads.append(n) or reader.tensor(n), convert, metas, plan))
    assert [n for n, _ in got] == [t.name for t in plan.tensors]
    assert sorted(reads) == sorted(set(reads)) and set(reads) <= set(names)
