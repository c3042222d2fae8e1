"""megatron-core 0.16.1 (CPU, gloo) as the peer for mixture-of-experts checkpoints.

Its ``GPTModel`` with MoE layers (tests/megatron_core_moe_peer.py: SequentialMLP, the legacy
GroupedMLP; shared experts with a gate; dense and MoE layers mixed; EP 2) saves ``torch_dist``
(the expert-axis keys and ``singleton_local_shards`` per-expert keys) and legacy per-EP-rank files,
with its own logits. Our reader of each must give those logits; megatron-core must load our
``torch_dist`` and legacy output (EP 1 and EP 2) and reproduce them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip(
    "megatron.core", reason="megatron-core is a test-only extra: pip install -e '.[megatron]'"
)

from pretrain.checkpoint.opener import load_canonical  # noqa: E402
from pretrain.checkpoint.verify import ours_probe  # noqa: E402
from tests.megatron_core_peer import PROBE  # noqa: E402
from tests.preimported import run_python
from tools.convert_cli import main as convert  # noqa: E402

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5


def _peer(*argv: str) -> None:
    proc = run_python("tests.megatron_core_moe_peer", list(argv))
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def peer(tmp_path_factory: pytest.TempPathFactory):
    """``peer(case, ep)``: the directory megatron-core saved that case into at TP 1 (built once)."""
    made: dict[tuple[str, int], Path] = {}

    def get(case: str, ep: int) -> Path:
        if (case, ep) not in made:
            out = tmp_path_factory.mktemp(f"{case}_ep{ep}")
            _peer("save", str(out), "--case", case, "--ep", str(ep))
            made[(case, ep)] = out
        return made[(case, ep)]

    return get


@pytest.mark.parametrize(("case", "ep", "fmts"), [
    ("moe", 1, ("dist", "dist_singleton", "legacy")),
    ("moe_shared", 2, ("dist", "dist_singleton", "legacy")),  # mixed layers: per-layer keys
    ("moe_grouped", 1, ("dist", "legacy")),  # GroupedMLP weight1/weight2 in the legacy files
])  # fmt: skip
def test_our_reader_computes_megatron_cores_moe(peer, case: str, ep: int, fmts: tuple[str, ...]) -> None:
    out = peer(case, ep)
    ref = torch.load(out / "logits.pt")
    for fmt in fmts:
        full, spec, info = load_canonical(out / fmt)
        assert spec.cfg.num_experts == 4 and (info.ep == ep or fmt != "legacy")
        got = ours_probe(full, spec, PROBE)
        assert (got - ref).abs().max().item() < TOL, fmt


@pytest.mark.parametrize(("fmt", "ep"), [("torch_dist", 2), ("torch", 2), ("torch_dist", 1)])
def test_megatron_core_loads_our_moe_output(peer, tmp_path: Path, fmt: str, ep: int) -> None:
    """Its legacy EP 2 files resharded by us (through tp2 pp2) to ``fmt`` at EP ``ep``; megatron-core
    loads them (strictly: every expert, router and shared-expert key) and gives its logits."""
    out = peer("moe_shared", 2)
    mid, save = tmp_path / "mid", tmp_path / "ours"
    assert convert(["reshard", "--load", str(out / "legacy"), "--save", str(mid), "--target-tp", "2",
                    "--target-pp", "2"]) == 0  # fmt: skip
    assert convert(["reshard", "--load", str(mid), "--save", str(save), "--target-tp", "1", "--target-pp", "1",
                    "--target-ep", str(ep), "--ckpt-format", fmt, "--verify"]) == 0  # fmt: skip
    it_dir = save / "iter_0000001"
    if fmt == "torch_dist":
        _peer("load", str(it_dir), str(tmp_path / "loaded"), "--case", "moe_shared", "--ep", str(ep))
    else:
        names = sorted(p.name for p in it_dir.iterdir())
        assert names == ["mp_rank_00_000", "mp_rank_00_001"]  # Megatron-LM's get_checkpoint_name
        _peer("load-legacy", str(save), str(tmp_path / "loaded"), "--case", "moe_shared", "--ep", str(ep))
    ref = torch.load(out / "logits.pt")
    assert (torch.load(tmp_path / "loaded" / "logits.pt") - ref).abs().max().item() < TOL


@pytest.mark.parametrize(("fmt", "tp", "ep", "etp"), [
    ("torch", 2, 1, 1), ("torch", 2, 2, 1), ("torch_dist", 1, 2, 2), ("torch_dist", 2, 1, 1),
])  # fmt: skip
def test_megatron_core_loads_our_moe_output_at_etp(
    peer, tmp_path: Path, fmt: str, tp: int, ep: int, etp: int
) -> None:
    """ETP other than TP: megatron-core, its expert groups built with ``expert_tensor_parallel_size``,
    loads our reshard (legacy: each TP rank's file holds its expert-TP shard t % ETP; torch_dist:
    global tensors, ETP in args) strictly and gives its logits."""
    out = peer("moe_shared", 2)
    save = tmp_path / "ours"
    assert convert(["reshard", "--load", str(out / "legacy"), "--save", str(save), "--target-tp", str(tp),
                    "--target-pp", "1", "--target-ep", str(ep), "--target-etp", str(etp), "--ckpt-format", fmt,
                    "--verify"]) == 0  # fmt: skip
    cmd, where = ("load", save / "iter_0000001") if fmt == "torch_dist" else ("load-legacy", save)
    _peer(cmd, str(where), str(tmp_path / "loaded"), "--case", "moe_shared", "--tp", str(tp), "--ep", str(ep),
          "--etp", str(etp))  # fmt: skip
    ref = torch.load(out / "logits.pt")
    assert (torch.load(tmp_path / "loaded" / "logits.pt") - ref).abs().max().item() < TOL


@pytest.mark.parametrize("experts", [2, 8])
def test_expert_count_disagreeing_with_args_refused(peer, tmp_path: Path, experts: int) -> None:
    """args num_experts 2 (tensors hold 4: experts 2, 3 are extra) or 8 (4 missing): one line."""
    import shutil

    from pretrain.checkpoint.opener import open_checkpoint
    from pretrain.utils.errors import UserError

    out = peer("moe", 1)
    for fmt in ("dist", "legacy"):
        root = tmp_path / f"{fmt}{experts}"
        shutil.copytree(out / fmt, root)
        name = "common.pt" if fmt == "dist" else "mp_rank_00/model_optim_rng.pt"
        path = root / "iter_0000001" / name
        state = torch.load(path, weights_only=False)
        state["args"].num_experts = experts
        torch.save(state, path)
        with pytest.raises(UserError) as exc:
            open_checkpoint(root)
        msg = str(exc.value)
        assert "\n" not in msg and ("expert" in msg or "router.weight" in msg), msg
