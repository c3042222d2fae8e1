"""Mixture-of-experts checkpoint files without megatron-core: expert-parallel legacy files
(Megatron-LM's ``mp_rank_TT[_PPP]_EEE``), ``torch_dist`` expert axes, megatron-core's other expert
layouts (TE grouped ``linear_fc1.weight{i}``, GroupedMLP ``weight1``/``weight2``), resharding across
TP x PP x EP x ETP with the optimizer state, and planted faults (one line, exit 2, nothing written)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from pretrain.checkpoint.legacy.layout import (
    MODEL_FILE,
    parse_expert_rank_dir,
    rank_dir_name,
)
from pretrain.checkpoint.legacy.writer import DictSource, WriteOptions, write_layout
from pretrain.checkpoint.opener import load_canonical, open_checkpoint
from pretrain.checkpoint.optimizer.reshard import open_optimizer_source, optimizer_writer
from pretrain.checkpoint.optimizer.state import OPTIM_STATES, OptimizerCommon
from pretrain.checkpoint.plan import ModelSpec, chunk_slots
from pretrain.checkpoint.upstream.expert_names import split_grouped
from pretrain.config import ModelConfig
from pretrain.parallel.config import ParallelConfig
from pretrain.utils.errors import UserError
from tools.convert_cli import main as convert

E, H, FFN = 4, 32, 16


def moe_cfg(**kw: Any) -> ModelConfig:
    base: dict[str, Any] = dict(
        num_layers=4, hidden_size=H, num_attention_heads=4, vocab_size=100, max_position_embeddings=32,
        normalization="RMSNorm", swiglu=True, position_embedding_type="rope", add_bias_linear=False,
        untie_embeddings_and_output_weights=True, num_experts=E, moe_router_topk=2, moe_ffn_hidden_size=FFN,
        ffn_hidden_size=48, hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    base.update(kw)
    return ModelConfig(**base)


def random_full(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Distinct random canonical tensors (router rows spread wide: top-k differs between tokens)."""
    g = torch.Generator().manual_seed(seed)
    spec = ModelSpec(kind="gpt", cfg=cfg)
    slots = chunk_slots(spec, tp=1, pre_process=True, post_process=True, layer_numbers=range(cfg.num_layers))
    out = {}
    for s in slots:
        shape = (cfg.vocab_size, *s.shape[1:]) if s.vocab else s.shape
        scale = 2.0 if s.canonical.endswith("router.weight") else 0.2
        out[s.canonical] = scale * torch.randn(shape, generator=g)
    return out


@dataclasses.dataclass
class _Adam:
    """An optimizer source whose every state is a distinct function of the weight."""

    full: dict[str, torch.Tensor]
    common: OptimizerCommon = OptimizerCommon(step=7, param_groups=({"lr": 1e-3, "betas": (0.9, 0.95),
                                              "eps": 1e-8, "weight_decay": 0.1},))  # fmt: skip
    scheduler: dict[str, Any] | None = None
    global_batch_size: int | None = 8

    def state(self, kind: str, canonical: str) -> torch.Tensor:
        w = self.full[canonical].float()
        return {"param": w, "exp_avg": 0.5 * w + 1, "exp_avg_sq": w.square() + 2}[kind]

    def state_stored_rows(self, kind: str, canonical: str) -> torch.Tensor:
        return self.state(kind, canonical)


def write_moe(root: Path, cfg: ModelConfig, full: dict[str, torch.Tensor], parallel: ParallelConfig) -> Path:
    spec = ModelSpec(kind="gpt", cfg=cfg)
    opt = _Adam(full)
    write_layout(DictSource(spec, full), root, parallel, options=WriteOptions(iteration=5),
                 optimizer=optimizer_writer(opt, spec, parallel))  # fmt: skip
    return root


def test_rank_dir_names_follow_megatron_lm() -> None:
    """``get_checkpoint_name``: ``_PPP`` when PP > 1, then ``_EEE`` when EP > 1."""
    assert rank_dir_name(1, 0, 1, 2) == "mp_rank_01_002"
    assert rank_dir_name(1, 3, 4, 2) == "mp_rank_01_003_002"
    assert rank_dir_name(1, 3, 4) == "mp_rank_01_003"
    assert parse_expert_rank_dir("mp_rank_01_002", pp=1, ep=4) == (1, 0, 2)
    assert parse_expert_rank_dir("mp_rank_01_002", pp=4, ep=1) == (1, 2, 0)
    assert parse_expert_rank_dir("mp_rank_01_003_002", pp=4, ep=4) == (1, 3, 2)


def test_ep_files_hold_their_experts_under_local_indices(tmp_path: Path) -> None:
    cfg = moe_cfg(num_layers=2)
    full = random_full(cfg)
    root = write_moe(tmp_path / "ep2", cfg, full, ParallelConfig(tp=1, pp=1, ep=2))
    it = root / "iter_0000005"
    assert sorted(p.name for p in it.iterdir()) == ["mp_rank_00_000", "mp_rank_00_001"]
    state = torch.load(it / "mp_rank_00_001" / MODEL_FILE, weights_only=False)
    key = "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"
    assert torch.equal(
        state["model"][key], full["language_model.encoder.layers.0.mlp.experts.3.dense_h_to_4h.weight"]
    )
    assert not any("local_experts.2." in k for k in state["model"])
    assert state["args"].expert_model_parallel_size == 2
    assert "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1._extra_state" in state["model"]
    assert "decoder.layers.0.mlp.linear_fc1._extra_state" not in state["model"]
    got, _, info = load_canonical(root)
    assert info.ep == 2 and got.keys() == full.keys()
    assert all(torch.equal(got[k], full[k]) for k in full)


@pytest.mark.slow  # 2.4-15 s on a 2-core host: out of the fast lane (under 2 min)
@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_reshard_round_trip_across_tp_pp_ep_is_exact(tmp_path: Path, fmt: str) -> None:
    """tp2 pp2 -> tp1 ep4 -> tp2 pp2 ep2 (-> torch_dist etp1), weights and optimizer state bit for bit."""
    cfg = moe_cfg(
        moe_layer_freq=(1, 0, 1, 1), moe_shared_expert_intermediate_size=24, moe_shared_expert_gate=True
    )
    full = random_full(cfg, seed=1)
    src = write_moe(tmp_path / "a", cfg, full, ParallelConfig(tp=2, pp=2))
    steps = [["--target-tp", "1", "--target-pp", "1", "--target-ep", "4"],
             ["--target-tp", "2", "--target-pp", "2", "--target-ep", "2"]]  # fmt: skip
    if fmt == "torch":  # virtual pipeline chunks with EP 4
        steps.append(["--target-tp", "1", "--target-pp", "2", "--target-vp", "2", "--target-ep", "4"])
        steps.append(["--target-tp", "2", "--target-pp", "2", "--target-ep", "2"])
    if fmt == "torch_dist":
        steps.append(["--target-tp", "2", "--target-pp", "1", "--target-ep", "2", "--target-etp", "1",
                      "--ckpt-format", "torch_dist"])  # fmt: skip
    for i, flags in enumerate(steps):
        dst = tmp_path / f"r{i}"
        assert convert(["reshard", "--load", str(src), "--save", str(dst), "--with-optimizer", *flags]) == 0
        src = dst
    got, _, info = load_canonical(src)
    assert info.ep == 2 and got.keys() == full.keys()
    assert all(torch.equal(got[k], full[k]) for k in full)
    opt = open_optimizer_source(open_checkpoint(src))
    ref = _Adam(full)
    for name in full:
        for kind in OPTIM_STATES:
            assert torch.equal(opt.state(kind, name), ref.state(kind, name)), (name, kind)
    assert opt.common.step == 7


@pytest.mark.parametrize(
    ("first", "etp"), [((2, 1), 1), ((4, 1), 2), ((4, 2), 1)], ids=["tp2_etp1", "tp4_etp2", "tp4_etp1_ep2"]
)
def test_legacy_files_at_etp_below_tp_round_trip_exactly(
    tmp_path: Path, first: tuple[int, int], etp: int
) -> None:
    """ETP dividing TP in legacy files: TP rank t's file holds expert-TP shard t % ETP (the
    experts megatron-core's rank at that TP rank owns); reshard to it and back, weights and
    optimizer state bit for bit, ETP recorded in args."""
    tp, ep = first
    cfg = moe_cfg(num_layers=2, moe_shared_expert_intermediate_size=24)
    full = random_full(cfg, seed=3)
    src = write_moe(tmp_path / "a", cfg, full, ParallelConfig(tp=2, pp=2))
    target = ["--target-tp", str(tp), "--target-pp", "1", "--target-ep", str(ep), "--target-etp", str(etp)]
    mid = tmp_path / "etp"
    assert convert(["reshard", "--load", str(src), "--save", str(mid), "--with-optimizer", *target]) == 0
    it = mid / "iter_0000005"
    names = sorted(p.name for p in it.iterdir())
    assert names == [rank_dir_name(t, 0, 1, e if ep > 1 else None) for t in range(tp) for e in range(ep)]
    state = torch.load(it / names[-1] / MODEL_FILE, weights_only=False)
    assert state["args"].expert_tensor_parallel_size == etp
    key = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"
    want = full[f"language_model.encoder.layers.0.mlp.experts.{(E // ep) * (ep - 1)}.dense_4h_to_h.weight"]
    assert torch.equal(state["model"][key], want.chunk(etp, dim=1)[(tp - 1) % etp])  # TP rank tp-1's shard
    back = tmp_path / "back"
    flags = ["--target-tp", "2", "--target-pp", "2"]
    assert convert(["reshard", "--load", str(mid), "--save", str(back), "--with-optimizer", *flags]) == 0
    for root in (mid, back):
        got, _, _ = load_canonical(root)
        assert got.keys() == full.keys() and all(torch.equal(got[k], full[k]) for k in full)
        opt = open_optimizer_source(open_checkpoint(root))
        for name in full:
            for kind in OPTIM_STATES:
                assert torch.equal(opt.state(kind, name), _Adam(full).state(kind, name)), (name, kind)


def test_legacy_etp_shards_that_differ_between_tp_files_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = moe_cfg(num_layers=2)
    root = write_moe(tmp_path / "a", cfg, random_full(cfg), ParallelConfig(tp=4, etp=2))
    f = root / "iter_0000005" / "mp_rank_02" / MODEL_FILE  # a copy of TP rank 0's expert shard
    state = torch.load(f, weights_only=False)
    state["model"]["decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight"] += 1
    torch.save(state, f)
    _refused(["reshard", "--load", str(root), "--save", str(tmp_path / "out"), "--target-tp", "1",
              "--target-pp", "1"])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "expert-TP shard 0 differs between" in err, err
    assert not (tmp_path / "out").exists()


def _mcore_layouts(root: Path, layout: str) -> None:
    """Rewrite our SequentialMLP rank files as TE grouped (``linear_fc1.weight{i}``) or GroupedMLP
    (``weight1 [h, E_local * rows]``, ``weight2 [E_local * I, h]``, each expert transposed)."""
    for f in root.glob("iter_*/mp_rank_*/" + MODEL_FILE):
        state = torch.load(f, weights_only=False)
        model: dict[str, Any] = {}
        grouped: dict[str, dict[int, torch.Tensor]] = {}
        for k, v in state["model"].items():
            if ".local_experts." not in k:
                model[k] = v
                continue
            base, rest = k.split(".local_experts.")
            i, linear, what = rest.split(".", 2)
            if what != "weight":
                continue  # the _extra_state entries
            if layout == "te":
                model[f"{base}.{linear}.weight{i}"] = v
            else:
                grouped.setdefault(f"{base}.{linear}", {})[int(i)] = v
        for key, experts in grouped.items():
            ws = [experts[i].t() for i in sorted(experts)]  # [h, rows] / [I, h]
            if key.endswith("linear_fc1"):
                model[key.replace("linear_fc1", "weight1")] = torch.stack(ws).reshape(H, -1).clone()
                assert torch.equal(torch.stack(ws).reshape(-1).reshape(len(ws), H, -1)[1], ws[1])
            else:
                model[key.replace("linear_fc2", "weight2")] = torch.cat(ws).clone()
        state["model"] = model
        torch.save(state, f)


@pytest.mark.parametrize("layout", ["te", "grouped"])
def test_reads_te_grouped_and_grouped_mlp_names(tmp_path: Path, layout: str) -> None:
    cfg = moe_cfg(num_layers=2)
    full = random_full(cfg, seed=2)
    root = write_moe(tmp_path / "ep2", cfg, full, ParallelConfig(tp=2, pp=1, ep=2))
    _mcore_layouts(root, layout)
    got, _, _ = load_canonical(root)
    assert all(torch.equal(got[k], full[k]) for k in full)


def test_grouped_mlp_split_is_megatron_cores_view() -> None:
    """GroupedMLP views ``weight1`` as ``[E, h, rows]`` and ``weight2`` as ``[E, I, h]`` (its forward)."""
    w1, w2 = torch.randn(H, 3 * 8), torch.randn(3 * 5, H)
    out = split_grouped({"x.mlp.experts.weight1": w1, "x.mlp.experts.weight2": w2}, local_experts=3, hidden=H,
                        where="f")  # fmt: skip
    assert torch.equal(out["x.mlp.experts.local_experts.2.linear_fc1.weight"], w1.view(3, H, -1)[2].t())
    assert torch.equal(out["x.mlp.experts.local_experts.1.linear_fc2.weight"], w2.view(3, -1, H)[1].t())
    with pytest.raises(UserError, match="weight1 has shape"):
        split_grouped({"x.mlp.experts.weight1": torch.randn(H + 1, 24)}, local_experts=3, hidden=H, where="f")


def _refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        convert(argv)
    assert exc.value.code == 2


def _fault(root: Path, fault: str) -> None:
    f = root / "iter_0000005" / "mp_rank_00_001" / MODEL_FILE
    state = torch.load(f, weights_only=False)
    key = "decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight"
    if fault == "missing":
        del state["model"][key]
    elif fault == "shape":
        state["model"][key] = state["model"][key][:, :-1].clone()
    else:  # an expert the args do not have
        state["model"][key.replace("local_experts.1", "local_experts.2")] = state["model"][key]
    torch.save(state, f)


@pytest.mark.parametrize(("fault", "words"), [
    ("missing", "mp_rank_00_001/model_optim_rng.pt: lacks expert tensor language_model.encoder.layers.1.mlp.experts.1"),
    ("shape", "linear_fc2.weight (language_model.encoder.layers.1.mlp.experts.3.dense_4h_to_h.weight) has shape"),
    ("extra", "is expert 2 of an EP rank that holds 2"),
])  # fmt: skip
def test_planted_expert_faults_one_line_nothing_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fault: str, words: str
) -> None:
    cfg = moe_cfg(num_layers=2)
    root = write_moe(tmp_path / "ep2", cfg, random_full(cfg), ParallelConfig(tp=1, pp=1, ep=2))
    _fault(root, fault)
    save = tmp_path / "out"
    _refused(["reshard", "--load", str(root), "--save", str(save), "--target-tp", "1", "--target-pp", "1"])
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err
    assert not save.exists()


@pytest.mark.parametrize(("flags", "words"), [
    (["--target-ep", "3"], "--target-ep 3: does not divide num_experts 4"),
    (["--target-etp", "2"], "--target-etp 2 does not divide --target-tp 1: legacy torch rank files are named"),
])  # fmt: skip
def test_bad_expert_layouts_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str],
                                    words: str) -> None:  # fmt: skip
    cfg = moe_cfg(num_layers=2)
    root = write_moe(tmp_path / "a", cfg, random_full(cfg), ParallelConfig(tp=1, pp=1))
    save = tmp_path / "out"
    argv = [
        "reshard",
        "--load",
        str(root),
        "--save",
        str(save),
        "--target-tp",
        "1",
        "--target-pp",
        "1",
        *flags,
    ]
    _refused(argv)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err
    assert not save.exists()


def test_expert_parallel_refused_for_a_dense_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = moe_cfg(num_experts=None, num_layers=2)
    root = write_moe(tmp_path / "a", cfg, random_full(cfg), ParallelConfig(tp=1, pp=1))
    save = tmp_path / "out"
    _refused(["reshard", "--load", str(root), "--save", str(save), "--target-tp", "1", "--target-pp", "1",
              "--target-ep", "2"])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert err == "error: --target-ep 2: the model has no experts (expert parallelism needs --num-experts)"
    assert not save.exists()


@pytest.mark.slow
def test_our_ep_training_checkpoint_reads_with_global_experts(
    gpt_data: dict[str, str], tmp_path: Path
) -> None:
    """mlm-pretrain with EP 2 (torchrun) writes mp_rank_00_000/_001 with local expert indices; the
    reader gives EP rank 1's local expert i as global expert 2 + i, and reshard to EP 1 keeps the logits."""
    from pretrain.checkpoint.legacy.layout import flatten
    from tests.distributed import launch
    from tests.test_moe_ep import MOE_FLAGS
    from tests.train_fixtures import gpt_args

    proc = launch(
        2,
        "pretrain.training.cli",
        gpt_args(gpt_data, **MOE_FLAGS, **{"train-iters": 2, "save": tmp_path / "ck"}),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    full, _, info = load_canonical(tmp_path / "ck")
    assert info.ep == 2
    files = [tmp_path / "ck" / "iter_0000002" / f"mp_rank_00_00{e}" / MODEL_FILE for e in range(2)]
    for e, f in enumerate(files):
        flat = flatten(torch.load(f, weights_only=False)["model"])
        for layer in range(2):
            for i in range(2):
                ours = f"language_model.encoder.layers.{layer}.mlp.experts.{2 * e + i}.dense_h_to_4h.weight"
                assert torch.equal(
                    flat[f"decoder.layers.{layer}.mlp.experts.local_experts.{i}.linear_fc1.weight"],
                    full[ours],
                )
    argv = [
        "reshard",
        "--load",
        str(tmp_path / "ck"),
        "--save",
        str(tmp_path / "ep1"),
        "--target-tp",
        "1",
        "--target-pp",
        "1",
        "--verify",
    ]
    assert convert(argv) == 0
