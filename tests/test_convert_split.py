"""``torchrun -n N mlm-convert ...`` splits the output files among the processes (issue 29 part 1).

Each conversion is run by one process (in this interpreter) and by 2 and 3 processes under
torchrun, and every output file is compared by sha256. ``torch_dist`` outputs are the exception:
DCP writes one data file per process (``__R_0.distcp``) and its ``.metadata`` holds a random save
id (two one-process runs already differ), so there every tensor our reader loads is compared
bitwise, and the other files (``common.pt``, ``metadata.json``, tracker, tokenizer) by sha256.
A rank that fails makes every rank stop with the same one line and leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch

from pretrain.checkpoint.opener import open_checkpoint
from pretrain.checkpoint.work_split import split_by_bytes
from tests.distributed import REPO, launch, torchrun
from tools.convert_cli import main
from tools.hf_plan import Planned, stream_hf_tensors
from tools.hf_shards import ShardWriter, split_shards, write_planned_shards


def test_split_by_bytes_gives_contiguous_balanced_runs() -> None:
    sizes = [5, 1, 1, 1, 4, 4, 2, 9, 3, 3]
    for world in (1, 2, 3, 4):
        owners = split_by_bytes(sizes, world)
        assert owners == sorted(owners) and owners[0] == 0 and max(owners) <= world - 1
        share = sum(sizes) / world
        for r in range(world):  # each rank within one output of an equal share
            got = sum(s for s, o in zip(sizes, owners, strict=True) if o == r)
            assert abs(got - share) <= max(sizes), (world, owners)
    assert split_by_bytes([7] * 4, 4) == [0, 1, 2, 3]
    assert split_by_bytes([0, 0, 0], 2) == [0, 0, 1]  # nothing to weigh: by count
    assert split_by_bytes([100, 1, 1], 3) == [1, 2, 2]  # a rank may get nothing


def test_shares_of_a_planned_export_are_the_one_writer_bytes(tmp_path: Path) -> None:
    """Three writers, each given only its shards' tensors (and reading only their sources), fill one
    directory with the bytes :class:`ShardWriter` writes alone."""
    gen = torch.Generator().manual_seed(0)
    full = {f"layers.{i}.w": torch.randn(4 + i, 8, generator=gen).bfloat16() for i in range(7)}
    full["head"] = torch.randn(16, 8, generator=gen)
    names = list(full)
    metas = {n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in full.items()}
    from tools.hf_plan import plan_hf_tensors

    def convert(chunk: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {f"hf.{k}": v for k, v in chunk.items()}

    plan = plan_hf_tensors(names, metas, convert)
    assert plan is not None
    one = tmp_path / "one"
    one.mkdir()
    writer = ShardWriter(one, max_shard_size=200, plan=plan.tensors)
    for name, t in stream_hf_tensors(names, full.__getitem__, convert, metas, plan):
        writer.add(name, t)
    writer.close()
    shards = split_shards(plan.tensors, 200)
    owners = split_by_bytes([sum(t.nbytes for t in s) for s in shards], 3)
    assert len(set(owners)) == 3
    split = tmp_path / "split"
    split.mkdir()
    for rank in range(3):
        owned = [o == rank for o in owners]
        wanted = {t.name for s, mine in zip(shards, owned, strict=True) if mine for t in s}
        read: list[str] = []

        def get(name: str) -> torch.Tensor:
            read.append(name)  # noqa: B023
            return full[name]

        tensors = stream_hf_tensors(names, get, convert, metas, plan, wanted=wanted)
        write_planned_shards(split, shards, owned, tensors)
        assert {f"hf.{n}" for n in read} == wanted  # only its own sources are read
    got = {p.name: p.read_bytes() for p in split.iterdir()}
    want = {p.name: p.read_bytes() for p in one.iterdir() if p.suffix == ".safetensors"}
    assert got == want


def test_a_tensor_unlike_the_shard_plan_is_refused(tmp_path: Path) -> None:
    shards = [[Planned("a", torch.float32, (2,))]]
    with pytest.raises(RuntimeError, match="departs from the shard plan"):
        write_planned_shards(tmp_path, shards, [True], [("a", torch.zeros(3))])


# ---------------------------------------------------------------- under torchrun (slow)


def _digests(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _same_output(one: Path, many: Path) -> None:
    """Every file byte-identical; for ``torch_dist`` the DCP files by what our reader loads."""
    a, b = _digests(one), _digests(many)
    dcp = {k for k in a.keys() | b.keys() if k.endswith((".distcp", "/.metadata"))}
    assert {k: v for k, v in a.items() if k not in dcp} == {k: v for k, v in b.items() if k not in dcp}
    if dcp:
        ra, rb = open_checkpoint(one), open_checkpoint(many)
        assert list(ra.names()) == list(rb.names())
        for name in ra.names():
            ta, tb = ra.stored_rows(name), rb.stored_rows(name)
            assert ta.dtype == tb.dtype and torch.equal(ta, tb), name


@pytest.fixture(scope="module")
def sources(tiny_gpt2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny GPT-2 as HF, as a legacy tp2 pp2 checkpoint and as ``torch_dist`` (with its tokenizer)."""
    root = tmp_path_factory.mktemp("split-sources")
    legacy, dist = root / "legacy", root / "dist"
    assert (
        main(["from-hf", "--load", str(tiny_gpt2_dir), "--save", str(legacy), "--tp", "2", "--pp", "2"]) == 0
    )
    argv = ["from-hf", "--load", str(tiny_gpt2_dir), "--save", str(dist), "--ckpt-format", "torch_dist"]
    assert main(argv) == 0
    from tests.moe_hf_fixtures import save_hf

    moe_hf, moe = root / "moe_hf", root / "moe"
    save_hf("mixtral", moe_hf)  # 6 experts, 2 layers
    argv = ["from-hf", "--load", str(moe_hf), "--save", str(moe), "--weights-only", "--pp", "2", "--ep", "2"]
    assert main(argv) == 0
    return {"hf": tiny_gpt2_dir, "legacy": legacy, "dist": dist, "moe_hf": moe_hf, "moe": moe}


CONVERSIONS: dict[str, tuple[str, list[str]]] = {
    "to-hf": ("legacy", ["to-hf", "--max-shard-size", "40KB"]),
    "to-hf verified": ("legacy", ["to-hf", "--max-shard-size", "40KB", "--verify", "full"]),
    "reshard tp2pp2->tp1pp2": ("legacy", ["reshard", "--target-tp", "1", "--target-pp", "2"]),
    "reshard tp2pp2->tp2pp1 --verify": ("legacy", ["reshard", "--target-tp", "2", "--target-pp", "1", "--verify"]),
    "legacy->torch_dist": ("legacy", ["reshard", "--target-tp", "1", "--target-pp", "1", "--ckpt-format", "torch_dist"]),
    "torch_dist->legacy": ("dist", ["reshard", "--target-tp", "2", "--target-pp", "2"]),
    "torch_dist->hf": ("dist", ["to-hf", "--max-shard-size", "40KB", "--no-verify"]),
    "from-hf": ("hf", ["from-hf", "--tp", "2", "--pp", "2"]),
    "from-hf torch_dist": ("hf", ["from-hf", "--tp", "2", "--ckpt-format", "torch_dist"]),
    "moe from-hf ep2": ("moe_hf", ["from-hf", "--weights-only", "--tp", "2", "--ep", "2"]),
    "moe reshard ep2->tp2": ("moe", ["reshard", "--target-tp", "2", "--target-pp", "1"]),
    "moe to-hf": ("moe", ["to-hf", "--weights-only", "--max-shard-size", "30KB"]),
}  # fmt: skip


# Every conversion at 2 processes; at 3 (uneven shares of layers and bytes) the paths that split
# differently: a planned HF export, a legacy re-layout, a torch_dist write and a torch_dist read.
UNEVEN = ("to-hf", "reshard tp2pp2->tp1pp2", "legacy->torch_dist", "torch_dist->hf")
SPLITS = [(case, 2) for case in CONVERSIONS] + [(case, 3) for case in UNEVEN]


@pytest.mark.slow
@pytest.mark.parametrize(("case", "nproc"), SPLITS, ids=[f"{c}-{n}" for c, n in SPLITS])
def test_n_processes_write_the_one_process_output(
    case: str, nproc: int, sources: dict[str, Path], tmp_path: Path
) -> None:
    source, argv = CONVERSIONS[case]
    one, many = tmp_path / "one", tmp_path / "many"
    assert main([*argv, "--load", str(sources[source]), "--save", str(one)]) == 0
    proc = launch(nproc, "tools.convert_cli", [*argv, "--load", str(sources[source]), "--save", str(many)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("wrote ") == 1, proc.stdout  # rank 0 alone reports
    _same_output(one, many)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["many", "one"]  # no temporary left


@pytest.mark.slow
def test_one_failing_rank_stops_all_with_one_line_and_leaves_nothing(
    sources: dict[str, Path], tmp_path: Path
) -> None:
    """The final LayerNorm's archive in the ``torch_dist`` data files cannot be read: only the last
    stage's rank reads it and fails; every rank exits 2, the error is printed once (no traceback of
    ours: the one left is the launcher's summary), nothing is left at ``--save``."""
    import torch.distributed.checkpoint as dcp

    broken = tmp_path / "broken"
    shutil.copytree(sources["dist"], broken)
    meta = dcp.FileSystemReader(str(broken / "release")).read_metadata()
    info = next(v for k, v in meta.storage_data.items() if k.fqn.startswith("decoder.final_layernorm"))
    data = broken / "release" / info.relative_path
    raw = bytearray(data.read_bytes())
    end = info.offset + info.length
    raw[end - 22 : end] = bytes(22)  # its zip directory is gone: found when that tensor is read
    data.write_bytes(bytes(raw))
    out = tmp_path / "out"
    argv = ["reshard", "--load", str(broken), "--save", str(out), "--target-tp", "1", "--target-pp", "2"]
    proc = torchrun(2, "tools.convert_cli", argv, timeout=300)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "cannot read tensor decoder.final_layernorm" in errors[0], proc.stderr[-3000:]
    assert proc.stderr.count("exitcode  : 2") == 2, proc.stderr[
        -3000:
    ]  # both ranks, in the launcher's summary
    ours = [line for line in proc.stderr.splitlines() if f'File "{REPO}/' in line and "/.venv/" not in line]
    assert not ours, ours  # the launcher's own traceback (torch, in a venv that may sit in the repo) aside
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken"]  # no --save, no temporary


def test_bench_runs_conversions_under_torchrun_with_nproc() -> None:
    from benchmarks.bench_convert_scale import convert_command

    assert convert_command(["to-hf"], 1)[1:] == ["-m", "tools.convert_cli", "to-hf"]
    assert convert_command(["to-hf"], 2)[1:] == ["-m", "torch.distributed.run", "--standalone",
                                                 "--nproc-per-node=2", "-m", "tools.convert_cli", "to-hf"]  # fmt: skip


@pytest.mark.slow  # about 50 s: one tiny model, two conversions under torchrun, each twice
def test_bench_convert_scale_nproc_smoke(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "benchmarks.bench_convert_scale", "--sizes", "tiny", "--nproc", "2",
           "--conversions", "to_hf,reshard", "--repeats", "2", "--workdir", str(tmp_path)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO)
    rec = json.loads(out.stdout.strip().splitlines()[-1])
    assert rec["nproc"] == 2 and rec["repeats"] == 2 and rec["sizes"][0]["to_hf"]["mb_per_s"] > 0
    reshard = rec["sizes"][0]["reshard"]
    assert reshard["mb_per_s"] > 0 and len(reshard["time_over_cp_runs"]) == 2
    assert min(reshard["time_over_cp_runs"]) <= reshard["time_over_cp"] <= max(reshard["time_over_cp_runs"])
    assert list(tmp_path.iterdir()) == []
