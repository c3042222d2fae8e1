"""Ctrl-C during a conversion's write: a real SIGINT to a running ``mlm-convert`` prints one line
``interrupted``, exits with 130 and leaves nothing (no output, no temporary sibling, no lock file, no
folder made for them), whatever the writer: legacy ``torch`` or ``torch_dist`` (whose dcp save and
load wrap the interrupt in their own exception), reshard, to-hf or from-hf."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.convert_fixtures import write_ours
from tests.gpt_fixtures import full_weights, tiny_config
from tests.slow_hook import start_held
from tools.convert_cli import main as convert_main

DIST_WRITE = "pretrain.checkpoint.torch_dist.writer:_ChunkMaker.__call__"  # an item being made
DIST_READ = "pretrain.checkpoint.torch_dist.reader:_copy_overlap"  # a stored chunk being read
LEGACY_WRITE = "pretrain.checkpoint.legacy.writer:_chunk_state"  # a rank file being built
HF_WRITE = "tools.hf_shards:ShardWriter.add"  # a safetensors shard being written
PP2 = ["--target-tp", "1", "--target-pp", "2"]

CASES = {  # name: (hook, source, argv after --load/--save)
    "reshard to torch_dist": (
        DIST_WRITE,
        "legacy",
        ["reshard", "--target-tp", "2", "--target-pp", "1", "--ckpt-format", "torch_dist"],
    ),  # fmt: skip
    "reshard torch_dist to torch pp2": (DIST_READ, "torch_dist", ["reshard", *PP2]),
    "reshard torch to torch pp2": (LEGACY_WRITE, "legacy", ["reshard", *PP2]),
    "to-hf": (HF_WRITE, "legacy", ["to-hf", "--vocab-size", "1003", "--weights-only"]),
    "from-hf to torch_dist": (
        DIST_WRITE,
        "hf",
        ["from-hf", "--tp", "1", "--pp", "1", "--ckpt-format", "torch_dist"],
    ),  # fmt: skip
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory, tiny_gpt2_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("interrupt-sources")
    cfg = tiny_config()
    legacy = write_ours(root / "legacy", cfg, full_weights(cfg), tp=1, pp=1)
    dist = root / "torch_dist"
    argv = ["reshard", "--load", str(legacy), "--save", str(dist), "--target-tp", "1", "--target-pp", "1"]
    assert convert_main([*argv, "--ckpt-format", "torch_dist"]) == 0
    return {"legacy": legacy, "torch_dist": dist, "hf": tiny_gpt2_dir}


def leftovers(save: Path) -> list[str]:
    """The output and anything beside it named after it (temporary siblings, the lock file)."""
    return sorted(
        p.name for p in save.parent.iterdir() if p.name == save.name or p.name.startswith(f".{save.name}")
    )


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_ctrl_c_during_a_write_says_interrupted_exits_130_and_leaves_nothing(
    sources: dict[str, Path], tmp_path: Path, case: str
) -> None:
    hook, source, argv = CASES[case]
    save = tmp_path / "out" / "new"
    argv = [argv[0], "--load", str(sources[source]), "--save", str(save), *argv[1:]]
    proc = start_held(hook, tmp_path / "hooked", "tools.convert_cli", argv)
    if hook != DIST_READ:  # a write is in progress: its temporary sibling exists
        assert [n for n in leftovers(save) if n.endswith(".tmp")], leftovers(save)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert err.strip() == "interrupted" and "wrote" not in out
    assert not save.parent.exists()  # not even the folder created for it
