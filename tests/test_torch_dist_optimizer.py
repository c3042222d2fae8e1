"""Optimizer state in ``torch_dist``: read, written and resharded with the weights.

The fast tests round-trip a known optimizer state (our per-rank files -> ``torch_dist`` -> our
files at another layout) and check the one-line refusals. The peer tests (slow) let
megatron-core 0.16.1 judge: its own optimizer loads what we write and trains on from it exactly
as from its own checkpoint, and we read what it writes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from unittest.mock import ANY

import pytest
import torch

from pretrain.checkpoint.legacy.writer import WriteOptions, write_layout
from pretrain.checkpoint.opener import load_canonical, open_checkpoint
from pretrain.checkpoint.optimizer.reshard import open_legacy_optimizer, optimizer_writer
from pretrain.checkpoint.optimizer.state import OPTIM_STATES, OptimizerCommon
from pretrain.checkpoint.torch_dist.reader import TorchDistReader
from pretrain.checkpoint.types import DictSource, Provenance
from pretrain.parallel.config import ParallelConfig
from pretrain.utils.errors import UserError
from tests.cli_helpers import one_line_error
from tests.preimported import run_python
from tests.test_torch_dist_reshard import _source
from tools.convert_cli import main as convert

SCHEDULE = {"lr": 3e-4, "min_lr": 3e-5, "decay_style": "cosine", "warmup_steps": 2, "decay_steps": 10,
            "by_samples": False, "num_steps": 5}  # fmt: skip
GROUPS = (
    {"lr": 2.5e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1},
    {"lr": 2.5e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0},
)


class _KnownState:
    """A made-up optimizer state (an ``OptimizerSource``): fp32 main params equal the weights
    (as in any fp32 run), distinct random moments; bf16 weights get distinct fp32 mains."""

    def __init__(self, src: DictSource, *, mixed: bool) -> None:
        gen = torch.Generator().manual_seed(11)
        self.tensors = {
            (kind, name): (t.float() if kind == "param" and not mixed else torch.rand(t.shape, generator=gen))
            for name, t in src.full.items()
            for kind in OPTIM_STATES
        }
        self.common = OptimizerCommon(step=5, param_groups=GROUPS, grad_scaler=None)
        self.scheduler: dict[str, object] | None = dict(SCHEDULE)
        self.global_batch_size: int | None = 8

    def state(self, kind: str, canonical: str) -> torch.Tensor:
        return self.tensors[(kind, canonical)]

    def state_stored_rows(self, kind: str, canonical: str) -> torch.Tensor:
        return self.tensors[(kind, canonical)]  # a made-up state stores no padding rows


def _legacy_with_optimizer(
    tmp: Path, *, dtype: str, layout: ParallelConfig, module_names: str | None = None
) -> tuple[Path, _KnownState]:
    src = _source(params_dtype=dtype)
    if dtype != "float32":
        src.full = {k: v.to(getattr(torch, dtype)) for k, v in src.full.items()}
    known = _KnownState(src, mixed=dtype != "float32")
    options = WriteOptions(iteration=5, opt_param_scheduler=dict(SCHEDULE),
                           provenance=Provenance(iteration=5, global_batch_size=8), module_names=module_names)  # fmt: skip
    write_layout(
        src, tmp / "legacy", layout, options=options, optimizer=optimizer_writer(known, src.spec, layout)
    )
    return tmp / "legacy", known


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    return one_line_error(convert, argv, capsys)


def _inspect_optimizer(path: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    """The ``optimizer`` record of ``mlm-convert inspect --json``."""
    capsys.readouterr()
    assert convert(["inspect", str(path), "--json"]) == 0
    opt: dict[str, object] = json.loads(capsys.readouterr().out)["optimizer"]
    return opt


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_optimizer_state_round_trips_through_torch_dist_exactly(
    tmp_path: Path, dtype: str, capsys: pytest.CaptureFixture[str]
) -> None:
    legacy, known = _legacy_with_optimizer(tmp_path, dtype=dtype, layout=ParallelConfig(tp=2, pp=2))
    assert convert(["reshard", "--load", str(legacy), "--save", str(tmp_path / "dist"), "--target-tp", "1",
                    "--target-pp", "1", "--ckpt-format", "torch_dist", "--with-optimizer", "--verify"]) == 0  # fmt: skip
    assert "verify: optimizer state identical" in capsys.readouterr().out
    assert _inspect_optimizer(tmp_path / "dist", capsys) == {"present": True, "reshardable": True, "step": 5,
                                                              "why": None}  # fmt: skip
    dist_reader = open_checkpoint(tmp_path / "dist")
    assert isinstance(dist_reader, TorchDistReader)
    stored = {k for k in dist_reader.meta if k.startswith("optimizer.state.")}
    assert any(k.startswith("optimizer.state.fp32_param.") for k in stored) == (dtype != "float32")
    common = torch.load(tmp_path / "dist/iter_0000005/common.pt", weights_only=False)
    inner = common["optimizer"]["optimizer"] if dtype != "float32" else common["optimizer"]
    assert [g["wd_mult"] for g in inner["param_groups"]] == [1.0, 0.0]
    assert common["opt_param_scheduler"]["num_steps"] == 5 * 8  # megatron counts samples
    assert convert(["reshard", "--load", str(tmp_path / "dist"), "--save", str(tmp_path / "back"), "--target-tp",
                    "4", "--target-pp", "2", "--with-optimizer", "--verify"]) == 0  # fmt: skip
    back = open_legacy_optimizer(open_checkpoint(tmp_path / "back"))
    assert back.common == known.common
    assert back.scheduler == SCHEDULE and back.global_batch_size == 8
    for (kind, name), want in known.tensors.items():
        assert torch.equal(back.state(kind, name), want), (kind, name)


def test_layout_bound_distributed_optimizer_state_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    legacy, _ = _legacy_with_optimizer(tmp_path, dtype="float32", layout=ParallelConfig(tp=1, pp=1))
    assert convert(["reshard", "--load", str(legacy), "--save", str(tmp_path / "dist"), "--target-tp", "1",
                    "--target-pp", "1", "--ckpt-format", "torch_dist", "--with-optimizer"]) == 0  # fmt: skip
    common_pt = tmp_path / "dist/iter_0000005/common.pt"
    common = torch.load(common_pt, weights_only=False)
    common["optimizer"] = {"param_state_sharding_type": "dp_reshardable", "optimizer": common["optimizer"]}
    torch.save(common, common_pt)
    err = _refused(["reshard", "--load", str(tmp_path / "dist"), "--save", str(tmp_path / "x"), "--target-tp",
                    "1", "--target-pp", "1", "--with-optimizer"], capsys)  # fmt: skip
    assert "'dp_reshardable'" in err and "--dist-ckpt-optim-fully-reshardable" in err
    assert not (tmp_path / "x").exists()
    opt = _inspect_optimizer(tmp_path / "dist", capsys)
    assert opt["present"] and not opt["reshardable"] and "dp_reshardable" in opt["why"]


def test_checkpoint_without_optimizer_state_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = _source()
    write_layout(src, tmp_path / "legacy", ParallelConfig(tp=1, pp=1))
    err = _refused(["reshard", "--load", str(tmp_path / "legacy"), "--save", str(tmp_path / "d"), "--target-tp",
                    "1", "--target-pp", "1", "--ckpt-format", "torch_dist", "--with-optimizer"], capsys)  # fmt: skip
    assert "holds no optimizer state" in err and not (tmp_path / "d").exists()
    assert _inspect_optimizer(tmp_path / "legacy", capsys) == {"present": False, "reshardable": False,
                                                                "step": None, "why": ANY}  # fmt: skip
    assert convert(["reshard", "--load", str(tmp_path / "legacy"), "--save", str(tmp_path / "d"), "--target-tp",
                    "1", "--target-pp", "1", "--ckpt-format", "torch_dist"]) == 0  # fmt: skip
    err = _refused(["reshard", "--load", str(tmp_path / "d"), "--save", str(tmp_path / "e"), "--target-tp", "1",
                    "--target-pp", "1", "--with-optimizer"], capsys)  # fmt: skip
    assert "holds no optimizer state" in err and not (tmp_path / "e").exists()


# --- megatron-core as the judge ------------------------------------------------------------------


def _peer(*argv: str, tp: int) -> None:
    proc = run_python("tests.megatron_core_optim_peer", [*argv, "--tp", str(tp)])
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "ours", "resume_tp", "bf16"),
    [
        # vocabulary 100 padded to 256 at tp2: megatron-core trains the padding rows; they are carried
        ("llama", ParallelConfig(tp=2, pp=2), 2, False),
        # bf16 params with fp32 main params, through a tp1 pp2 layout, resumed at tp1
        ("llama_v256", ParallelConfig(tp=1, pp=2), 1, True),
    ],
    ids=["fp32-padded-vocab", "bf16"],
)
def test_megatron_core_resumes_from_our_conversion_as_from_its_own_checkpoint(
    tmp_path: Path, case: str, ours: ParallelConfig, resume_tp: int, bf16: bool
) -> None:
    """megatron-core trains 4 steps at tp2 saving after step 2, as torch_dist (``ckpt``) and as
    Megatron-LM's legacy torch save (``legacy``: the optimizer's own state_dict(), keyed by
    position); we take each through our layout (with optimizer) to torch_dist (tp2);
    megatron-core resuming from ours and from its own torch_dist checkpoint loads the same
    optimizer state and trains to the same weights, bit for bit; and its resumed losses equal
    the uninterrupted run's."""
    _peer("train", str(tmp_path / "run"), "--case", case, "--steps", "4", "--save-at", "2",
          *(["--bf16"] if bf16 else []), tp=2)  # fmt: skip
    ckpt = tmp_path / "run/ckpt"
    _peer("resume", str(ckpt / "iter_0000002"), str(tmp_path / "from_own"), "--steps", "4", tp=resume_tp)
    own = torch.load(tmp_path / "from_own/loaded_state.pt")
    assert any(k.startswith("exp_avg_sq.") for k in own["state"])
    assert any(k.startswith("fp32_param.") for k in own["state"]) == bf16
    for source in ("ckpt", "legacy"):
        _check_resume_from_ours(tmp_path, tmp_path / "run" / source, source, ours, resume_tp, own)


def _check_resume_from_ours(
    tmp_path: Path, load: Path, tag: str, ours: ParallelConfig, resume_tp: int, own: dict[str, Any]
) -> None:
    mine, dist, resumed = tmp_path / f"ours_{tag}", tmp_path / f"dist_{tag}", tmp_path / f"from_ours_{tag}"
    assert convert(["reshard", "--load", str(load), "--save", str(mine), "--target-tp", str(ours.tp),
                    "--target-pp", str(ours.pp), "--with-optimizer", "--verify"]) == 0  # fmt: skip
    assert convert(["reshard", "--load", str(mine), "--save", str(dist), "--target-tp", "2", "--target-pp", "1",
                    "--with-optimizer", "--ckpt-format", "torch_dist"]) == 0  # fmt: skip
    _peer("resume", str(dist / "iter_0000002"), str(resumed), "--steps", "4", tp=resume_tp)
    theirs = torch.load(resumed / "loaded_state.pt")
    assert own["num_steps"] == theirs["num_steps"] == 2 * 4
    assert sorted(own["state"]) == sorted(theirs["state"]), tag
    for key, want in own["state"].items():
        assert torch.equal(theirs["state"][key], want), (tag, key)
    for name in ("losses.pt", "params.pt"):
        a, b = (torch.load(d / name) for d in (tmp_path / "from_own", resumed))
        if isinstance(a, dict):
            assert all(torch.equal(a[k], b[k]) for k in a), (tag, name)
        else:
            assert torch.equal(a, b), (tag, name)
    full = torch.load(tmp_path / "run/losses.pt")
    torch.testing.assert_close(torch.load(resumed / "losses.pt"), full[2:], rtol=1e-4, atol=0)


def _mcore_name_to_ref(name: str) -> tuple[str, int | None]:
    """A megatron-core parameter name -> its torch_dist key and layer (the local spec saves the
    norms under the TransformerEngine names and stacks layers)."""
    from tests.megatron_core_peer import _TE_RENAMES

    for old, new in _TE_RENAMES:
        name = name.replace(old, new)
    parts = name.split(".")
    if "layers" in parts:
        i = parts.index("layers")
        return ".".join(parts[: i + 1] + parts[i + 2 :]), int(parts[i + 1])
    return name, None


@pytest.mark.slow
def test_megatron_core_loads_the_optimizer_state_of_our_training_run(
    gpt_data: dict[str, str], tmp_path: Path
) -> None:
    """Our engine trains a Llama-style model 3 steps (weight decay on); reshard to torch_dist tp2
    with the optimizer; megatron-core loads model, optimizer and schedule at tp2, and every
    state tensor it holds equals ours (true vocabulary rows)."""
    from pretrain.training.cli import main as pretrain_main
    from tests.test_llama_resume import LLAMA
    from tests.train_fixtures import gpt_args

    flags = {"train-iters": 3, "weight-decay": 0.1, "save": tmp_path / "run", "lr-decay-style": "cosine",
             "lr-decay-iters": 10, "num-attention-heads": 4}  # fmt: skip
    assert pretrain_main(gpt_args(gpt_data, **LLAMA, **flags)) == 0  # type: ignore[arg-type]
    assert convert(["reshard", "--load", str(tmp_path / "run"), "--save", str(tmp_path / "dist"), "--target-tp",
                    "2", "--target-pp", "1", "--with-optimizer", "--ckpt-format", "torch_dist"]) == 0  # fmt: skip
    _peer("resume", str(tmp_path / "dist/iter_0000003"), str(tmp_path / "peer"), "--steps", "3", tp=2)
    loaded = torch.load(tmp_path / "peer/loaded_state.pt")
    ours = open_legacy_optimizer(open_checkpoint(tmp_path / "run"))
    refs = open_checkpoint(tmp_path / "dist").refs  # type: ignore[attr-defined]
    by_ref = {(r.key, r.layer): name for name, r in refs.items()}
    _, spec, _ = load_canonical(tmp_path / "run")
    vocab = spec.cfg.vocab_size
    assert loaded["num_steps"] == 3 * 8  # iterations x global batch: megatron counts samples
    checked = 0
    for key, got in loaded["state"].items():
        kind, _, pname = key.partition(".")
        if kind == "step":
            assert int(got) == 3, key
            continue
        if kind == "wd":  # megatron-core matched our groups: no decay on norms (Megatron's rule)
            assert float(got) == pytest.approx(0.0 if "layernorm" in pname else 0.1), key
            continue
        want = ours.state(kind, by_ref[_mcore_name_to_ref(pname)])
        got = got[:vocab] if got.shape[0] > want.shape[0] else got
        assert torch.equal(got, want), key
        checked += 1
    assert checked == 2 * len(refs)


def test_verify_names_the_first_optimizer_tensor_that_differs(tmp_path: Path) -> None:
    from pretrain.checkpoint.verify import verify_optimizer

    legacy, known = _legacy_with_optimizer(tmp_path, dtype="float32", layout=ParallelConfig(tp=2, pp=1))
    name = next(n for k, n in known.tensors if k == "exp_avg")
    known.tensors[("exp_avg", name)] = known.tensors[("exp_avg", name)].clone().add_(1e-7)
    other = tmp_path / "other"
    other.mkdir()
    layout = ParallelConfig(tp=1, pp=2)
    src = _source()
    write_layout(src, other / "ck", layout, options=WriteOptions(iteration=5, opt_param_scheduler=dict(SCHEDULE)),
                 optimizer=optimizer_writer(known, src.spec, layout))  # fmt: skip
    with pytest.raises(UserError, match=f"optimizer state exp_avg of {name} differs"):
        verify_optimizer(legacy, other / "ck")


def test_optimizer_state_of_legacy_model_files_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """torch's optimizer state in a legacy-model Megatron-LM file is keyed by parameter position in
    that version's own order: refused, naming the format that carries it by name."""
    from pretrain.checkpoint.metadata import OURS

    legacy, _ = _legacy_with_optimizer(tmp_path, dtype="float32", layout=ParallelConfig(tp=1, pp=1))
    path = legacy / "iter_0000005/mp_rank_00/model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    delattr(state["args"], OURS)  # Megatron-LM's own args only: an upstream file
    state["args"].use_legacy_models, state["args"].use_mcore_models = True, False
    torch.save(state, path)
    assert not open_checkpoint(legacy).info.ours
    err = _refused(["reshard", "--load", str(legacy), "--save", str(tmp_path / "x"), "--target-tp", "1",
                    "--target-pp", "1", "--with-optimizer"], capsys)  # fmt: skip
    assert "legacy-model Megatron-LM files" in err and "--ckpt-format torch_dist" in err
    assert not (tmp_path / "x").exists()


def test_position_keyed_torch_state_is_named_in_megatron_cores_group_order() -> None:
    """torch's AdamW ``state_dict()`` over megatron-core's groups ([decay params], [biases and
    1-D params], each in model order) is named back by the model order alone; a file whose
    groups do not line up with that order is refused rather than misnamed."""
    from pretrain.checkpoint.upstream.optimizer import UpstreamParam, upstream_full_state

    gen = torch.Generator().manual_seed(0)
    named = [("a.weight", torch.randn(4, 3, generator=gen)), ("a.bias", torch.randn(4, generator=gen)),
             ("norm.weight", torch.randn(3, generator=gen)), ("b.weight", torch.randn(2, 4, generator=gen))]  # fmt: skip
    params = {n: torch.nn.Parameter(t.clone()) for n, t in named}
    decay, no_decay = ["a.weight", "b.weight"], ["a.bias", "norm.weight"]
    adam = torch.optim.AdamW([{"params": [params[n] for n in decay], "weight_decay": 0.1},
                              {"params": [params[n] for n in no_decay], "weight_decay": 0.0}], lr=1e-2)  # fmt: skip
    for p in params.values():
        p.grad = torch.randn(p.shape, generator=gen)
    adam.step()
    ups = [UpstreamParam(f"model0.{n}", n, params[n].detach()) for n, _ in named]
    full = upstream_full_state(adam.state_dict(), ups, source="f")
    assert full["step"] == 1 and [g["weight_decay"] for g in full["param_groups"]] == [0.1, 0.0]
    for n, p in params.items():
        assert torch.equal(full["params"][f"model0.{n}"]["exp_avg"], adam.state[p]["exp_avg"])
        assert torch.equal(full["params"][f"model0.{n}"]["param"], p.detach())
    swapped = adam.state_dict()
    swapped["param_groups"] = swapped["param_groups"][::-1]
    swapped["param_groups"][0]["params"] = [0, 1, 2]  # three in the first group: another era's order
    swapped["param_groups"][1]["params"] = [3]
    with pytest.raises(UserError, match=r"optimizer groups hold \[3, 1\] parameters"):
        upstream_full_state(swapped, ups, source="f")


@pytest.mark.slow
def test_distributed_optimizer_fully_reshardable_state_read_and_written(tmp_path: Path) -> None:
    """megatron-core's DistributedOptimizer (DDP-wrapped, tp2) trains 2 steps and saves with
    Megatron-LM's --dist-ckpt-optim-fully-reshardable. What we read (through our layout) equals,
    tensor for tensor, the state its own accessor reports after those steps; and what we write
    with --dist-optimizer (through our tp2 pp2 layout) is loaded by its ``dist_checkpointing.load``
    for that optimizer exactly as its own file: every rank's param_state, groups and schedule."""
    _peer(
        "train", str(tmp_path / "run"), "--case", "llama", "--steps", "2", "--save-at", "2", "--distopt", tp=2
    )
    ckpt = tmp_path / "run/ckpt"
    common = torch.load(ckpt / "iter_0000002/common.pt", weights_only=False)
    assert common["optimizer"]["param_state_sharding_type"] == "fully_reshardable"
    assert convert(["reshard", "--load", str(ckpt), "--save", str(tmp_path / "ours"), "--target-tp", "1",
                    "--target-pp", "2", "--with-optimizer", "--verify"]) == 0  # fmt: skip
    ours = open_legacy_optimizer(open_checkpoint(tmp_path / "ours"))
    assert ours.common.step == 2 and ours.scheduler is not None and ours.scheduler["num_steps"] == 2
    refs = open_checkpoint(ckpt).refs  # type: ignore[attr-defined]
    by_ref = {(r.key, r.layer): name for name, r in refs.items()}
    saved = torch.load(tmp_path / "run/saved_state.pt")
    assert {k.partition(".")[0] for k in saved} == {"param", "exp_avg", "exp_avg_sq"}
    for key, want in saved.items():
        kind, _, pname = key.partition(".")
        got = ours.state(kind, by_ref[_mcore_name_to_ref(pname)])
        assert torch.equal(got, want[: got.shape[0]]), key  # (true vocabulary rows)
    assert len(saved) == 3 * len(refs)
    # written: through tp2 pp2 (the padded vocabulary of tp2 is kept) to the distributed form
    assert convert(["reshard", "--load", str(ckpt), "--save", str(tmp_path / "ours2"), "--target-tp", "2",
                    "--target-pp", "2", "--with-optimizer"]) == 0  # fmt: skip
    assert convert(["reshard", "--load", str(tmp_path / "ours2"), "--save", str(tmp_path / "dist"), "--target-tp",
                    "2", "--target-pp", "1", "--with-optimizer", "--ckpt-format", "torch_dist",
                    "--dist-optimizer"]) == 0  # fmt: skip
    _peer("load_distributed", str(ckpt / "iter_0000002"), str(tmp_path / "own"), tp=2)
    _peer("load_distributed", str(tmp_path / "dist/iter_0000002"), str(tmp_path / "theirs"), tp=2)
    for rank in (0, 1):
        own, theirs = (torch.load(tmp_path / d / f"rank{rank}.pt") for d in ("own", "theirs"))
        assert theirs["sharding"] == "fully_reshardable"
        assert own["param_groups"] == theirs["param_groups"] and own["scheduler"] == theirs["scheduler"]
        assert sorted(own["param_state"]) == sorted(theirs["param_state"])
        for i, state in own["param_state"].items():
            for kind, t in state.items():
                assert torch.equal(theirs["param_state"][i][kind], t), (rank, i, kind)


def test_dist_optimizer_flag_needs_torch_dist_with_optimizer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    legacy, _ = _legacy_with_optimizer(tmp_path, dtype="float32", layout=ParallelConfig(tp=1, pp=1))
    err = _refused(["reshard", "--load", str(legacy), "--save", str(tmp_path / "x"), "--target-tp", "1",
                    "--target-pp", "1", "--dist-optimizer", "--with-optimizer"], capsys)  # fmt: skip
    assert "--dist-optimizer needs --with-optimizer and --ckpt-format torch_dist" in err
    assert convert(["reshard", "--load", str(legacy), "--save", str(tmp_path / "d"), "--target-tp", "1",
                    "--target-pp", "1", "--with-optimizer", "--ckpt-format", "torch_dist", "--dist-optimizer",
                    "--verify"]) == 0  # fmt: skip
    common = torch.load(tmp_path / "d/iter_0000005/common.pt", weights_only=False)
    assert common["optimizer"]["param_state_sharding_type"] == "fully_reshardable"
    assert common["content_metadata"] == {"distrib_optim_sharding_type": "fully_reshardable"}
    assert [g["step"] for g in common["optimizer"]["optimizer"]["param_groups"]] == [5.0, 5.0]
