"""mlm-convert reshard / inspect: layout round trips, loading at the target layout, memory, errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from pretrain.checkpoint.legacy.io import load_checkpoint
from pretrain.checkpoint.legacy.layout import MODEL_FILE
from pretrain.checkpoint.opener import open_checkpoint
from pretrain.models.sharding import gather_full_state_dict
from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.state import ParallelState
from pretrain.pipeline.partition import build_model_chunks
from tests.convert_fixtures import write_ours
from tests.distributed import run_distributed
from tests.gpt_fixtures import batch, full_weights, single_process_reference, tiny_config
from tools.convert_cli import main

CFG = tiny_config(num_layers=4)


@pytest.fixture(scope="module")
def full() -> dict[str, torch.Tensor]:
    return full_weights(CFG)


def _reshard(src: Path, dst: Path, tp: int, pp: int, vp: int = 1) -> None:
    argv = ["reshard", "--load", str(src), "--save", str(dst), "--target-tp", str(tp), "--target-pp", str(pp)]
    assert main([*argv, "--target-vp", str(vp)]) == 0


def test_round_trip_chain_keeps_every_tensor(tmp_path: Path, full) -> None:
    src = write_ours(tmp_path / "a", CFG, full, tp=2, pp=2)
    chain = [(1, 1, 1), (4, 1, 1), (1, 2, 2), (2, 4, 1), (2, 2, 2)]
    for i, (tp, pp, vp) in enumerate(chain):
        dst = tmp_path / f"b{i}"
        _reshard(src, dst, tp, pp, vp)
        reader = open_checkpoint(dst)
        assert (reader.info.tp, reader.info.pp, reader.info.vp, reader.info.iteration) == (tp, pp, vp, 3)
        assert set(reader.names()) == set(full)
        for name, t in full.items():
            assert torch.equal(reader.tensor(name), t), (tp, pp, vp, name)
        src = dst
    emb = torch.load(tmp_path / "b1/iter_0000003/mp_rank_03/" / MODEL_FILE, weights_only=True)
    rows = emb["model"]["embedding.word_embeddings.weight"]  # reshard writes megatron-core names
    assert rows.shape == (1024 // 4, CFG.hidden_size)  # padding recomputed for tp=4
    assert torch.count_nonzero(rows[1003 - 3 * 256 :]) == 0  # padded rows carry nothing


def _load_and_run(rank: int, world: int, root: str, tp: int, pp: int, vp: int, data):
    ps = ParallelState.from_distributed(ParallelConfig(tp=tp, pp=pp, vp=vp), seed=0)
    chunks = build_model_chunks(CFG, ps)
    load_checkpoint(root, chunks, ps)
    out: dict[str, torch.Tensor] = {}
    for c in chunks:
        out.update(gather_full_state_dict(c))
    if pp == 1:
        model: Any = chunks[0]
        model.eval()
        with torch.no_grad():
            out["__logits__"] = model.full_logits(model(data["tokens"]))
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "pp", "vp"), [(4, 1, 1), (1, 2, 2)])
def test_resharded_checkpoint_loads_at_target_layout(tmp_path: Path, full, tp: int, pp: int, vp: int) -> None:
    src = write_ours(tmp_path / "a", CFG, full, tp=2, pp=2)
    _reshard(src, tmp_path / "b", tp, pp, vp)
    data = batch(CFG)
    results = run_distributed(_load_and_run, tp * pp, str(tmp_path / "b"), tp, pp, vp, data)
    merged: dict[str, torch.Tensor] = {}
    for r in results:
        merged.update(r)
    for name, t in full.items():
        assert torch.equal(merged[name], t), name
    if pp == 1:
        ref_logits, _, _ = single_process_reference(CFG, full, data)
        torch.testing.assert_close(merged["__logits__"], ref_logits, atol=1e-5, rtol=0)


def test_reshard_errors_leave_no_output(tmp_path: Path, full, capsys) -> None:
    src = write_ours(tmp_path / "a", CFG, full, tp=2, pp=1)
    with pytest.raises(SystemExit) as err:
        _reshard(src, tmp_path / "b", 3, 1)  # 8 heads over 3 ranks
    assert err.value.code == 2 and "not divisible by --target-tp 3" in capsys.readouterr().err
    assert not (tmp_path / "b").exists() and not list(tmp_path.glob(".b.*"))
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "keep.txt").write_text("x")
    with pytest.raises(SystemExit):
        _reshard(src, tmp_path / "c", 1, 1)
    assert "not empty" in capsys.readouterr().err and (tmp_path / "c" / "keep.txt").exists()


def test_inspect_reports_layout_and_problems(tmp_path: Path, full, capsys) -> None:
    src = write_ours(tmp_path / "a", CFG, full, tp=2, pp=2)
    assert main(["inspect", str(src), "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert (rec["ok"], rec["tp"], rec["pp"], rec["kind"], rec["vocab_size"]) == (True, 2, 2, "gpt", 1003)
    assert rec["num_parameters"] == sum(t.numel() for t in full.values())
    # a replicated LayerNorm that differs between TP ranks
    path = src / "iter_0000003/mp_rank_01_000" / MODEL_FILE
    state = torch.load(path, weights_only=True)
    state["model"]["language_model"]["encoder"]["layers.1.input_layernorm.weight"] += 1
    torch.save(state, path)
    assert main(["inspect", str(src)]) == 1
    out = capsys.readouterr().out
    assert "layers.1.input_layernorm.weight" in out and "INCONSISTENT" in out
    # a missing shard directory
    for f in (src / "iter_0000003/mp_rank_00_001").iterdir():
        f.unlink()
    (src / "iter_0000003/mp_rank_00_001").rmdir()
    with pytest.raises(SystemExit) as err:
        main(["inspect", str(src)])
    assert err.value.code == 2 and "mp_rank_00_001" in capsys.readouterr().err


_MEMORY_SCRIPT = textwrap.dedent(
    """
    import sys, threading, time
    import torch
    from pretrain.checkpoint.opener import open_checkpoint
    from pretrain.checkpoint.legacy.writer import write_layout
    from pretrain.parallel.config import ParallelConfig

    def anon_kb():
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
        raise RuntimeError("no RssAnon")

    peak = [0]
    done = threading.Event()
    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], anon_kb())
            time.sleep(0.0005)
    reader = open_checkpoint(sys.argv[1])
    base = anon_kb()
    t = threading.Thread(target=sample)
    t.start()
    write_layout(reader, sys.argv[2], ParallelConfig(tp=4, pp=1))
    done.set()
    t.join()
    print((peak[0] - base) * 1024)
    """
)


@pytest.mark.slow  # > 10 s
def test_reshard_peak_memory_below_model_size(tmp_path: Path) -> None:
    cfg = tiny_config(num_layers=16, hidden_size=256, num_attention_heads=8, max_position_embeddings=64)
    gen = torch.Generator().manual_seed(0)
    from pretrain.models.gpt import GPTModel

    names = {
        n: tuple(p.shape) for n, p in GPTModel(cfg, ParallelState.single(device="meta")).named_parameters()
    }
    big = {n: torch.randn(s, generator=gen) for n, s in names.items()}
    big["language_model.embedding.word_embeddings.weight"] = big[
        "language_model.embedding.word_embeddings.weight"
    ][:1003]
    model_bytes = sum(t.numel() * 4 for t in big.values())
    src = write_ours(tmp_path / "a", cfg, big, tp=2, pp=2)
    del big
    script = tmp_path / "mem.py"
    script.write_text(_MEMORY_SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script), str(src), str(tmp_path / "b")],
        capture_output=True, text=True, check=True, cwd=Path(__file__).parents[1],
        # Freed tensors go back to the OS at once, so RssAnon tracks live memory, not glibc's cache.
        env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"},
    )  # fmt: skip
    peak = int(out.stdout.strip().splitlines()[-1])
    assert model_bytes > 40e6
    # target shard = model / 4; the source shards are mmap'd (file pages, not anonymous memory)
    assert peak < 0.75 * model_bytes, (peak, model_bytes)
    reader = open_checkpoint(tmp_path / "b")
    assert reader.info.tp == 4 and reader.info.num_parameters * 4 == model_bytes


def test_reshard_with_optimizer_moves_states_with_their_parameters(tmp_path: Path, full) -> None:
    from pretrain.checkpoint.legacy.writer import DictSource, WriteOptions, write_layout
    from pretrain.checkpoint.plan import ModelSpec
    from pretrain.models.sharding import shard_tensor

    def states(tp_rank, pp_rank, slots):  # exp_avg = 2 * param, exp_avg_sq = param ** 2
        params = {}
        for c, chunk in enumerate(slots):
            for s in chunk:
                p = shard_tensor(
                    full[s.canonical], dim=s.dim, tp_rank=tp_rank, tp=2, pad_rows_to=1024 if s.vocab else None
                )
                params[f"model{c}.{s.local}"] = {"param": p, "exp_avg": 2 * p, "exp_avg_sq": p * p}
        return {"params": params, "step": 3, "param_groups": [{"lr": 0.1}], "grad_scaler": None}

    src = DictSource(ModelSpec(kind="gpt", cfg=CFG), full)
    write_layout(
        src, tmp_path / "a", ParallelConfig(tp=2, pp=2), options=WriteOptions(iteration=3), optimizer=states
    )
    argv = [
        "--load",
        str(tmp_path / "a"),
        "--save",
        str(tmp_path / "b"),
        "--target-tp",
        "1",
        "--target-pp",
        "4",
    ]
    assert main(["reshard", *argv, "--with-optimizer"]) == 0
    for pp_rank in range(4):
        state = torch.load(
            tmp_path / f"b/iter_0000003/mp_rank_00_{pp_rank:03d}" / MODEL_FILE, weights_only=True
        )
        opt = state["optimizer"]
        assert opt["step"] == 3 and opt["param_groups"] == [{"lr": 0.1}]
        from pretrain.checkpoint.legacy.layout import flatten
        from pretrain.checkpoint.upstream.names import to_local_name

        # the model file uses megatron-core names; optimizer states are keyed by our local names
        model = {to_local_name(k): v for k, v in flatten(state["model"]).items()}
        assert set(opt["params"]) == {f"model0.{k}" for k in model}
        for k, p in model.items():
            entry = opt["params"][f"model0.{k}"]
            assert torch.equal(entry["param"], p) and torch.equal(entry["exp_avg"], 2 * p), k
            assert torch.equal(entry["exp_avg_sq"], p * p), k
