"""No silent expert loss: planted faults in MoE checkpoints are each caught loudly -- one line naming
the tensor, exit 2, nothing written -- or, for faults that keep every shape (two experts swapped),
by ``to-hf --verify``'s logit and router comparison."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pretrain.checkpoint.plan import ModelSpec
from pretrain.checkpoint.types import DictSource
from pretrain.checkpoint.verify_routes import Routes
from pretrain.utils.errors import UserError
from tests.cli_helpers import one_line_error
from tests.moe_hf_fixtures import hf_model, import_state, save_hf
from tools.convert_cli import main
from tools.hf_io import export_hf
from tools.hf_verify import verify_export

pytest.importorskip("transformers")
L0 = "model.layers.0.mlp."


def _rewrite(directory: Path, change) -> None:  # type: ignore[no-untyped-def]
    path = directory / "model.safetensors"
    state = dict(load_file(str(path)))
    change(state)
    save_file(state, str(path), metadata={"format": "pt"})


def _from_hf_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()  # save_pretrained's progress bar
    err = one_line_error(main, ["from-hf", "--load", str(tmp_path / "hf"), "--save", str(tmp_path / "ck"),
                                "--tp", "2", "--weights-only"], capsys)  # fmt: skip
    assert not (tmp_path / "ck").exists()
    return err


def test_missing_expert_tensor(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save_hf("qwen3_moe", tmp_path / "hf")
    _rewrite(tmp_path / "hf", lambda s: s.pop(L0 + "experts.3.up_proj.weight"))
    assert "missing tensor model.layers.0.mlp.experts.3.up_proj.weight" in _from_hf_error(tmp_path, capsys)


def test_expert_count_disagreeing_with_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save_hf("mixtral", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "num_local_experts": 5}))
    err = _from_hf_error(tmp_path, capsys)
    assert "experts.5" in err and "num_experts=5" in err and "disagree" in err


def test_transposed_per_expert_matrix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save_hf("qwen3_moe", tmp_path / "hf")
    name = L0 + "experts.3.down_proj.weight"
    _rewrite(tmp_path / "hf", lambda s: s.__setitem__(name, s[name].t().contiguous()))
    assert f"{name} has shape [24, 32], expected [32, 24] [hidden, width] (transposed)" in _from_hf_error(
        tmp_path, capsys
    )


def test_topk_beyond_the_expert_count_in_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save_hf("qwen2_moe", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "num_experts_per_tok": 7}))
    assert "moe_router_topk 7 must be in [1, num_experts 6]" in _from_hf_error(tmp_path, capsys)


def test_zeroed_router(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save_hf("olmoe", tmp_path / "hf")
    _rewrite(tmp_path / "hf", lambda s: s[L0 + "gate.weight"].zero_())
    assert f"{L0}gate.weight is all zeros" in _from_hf_error(tmp_path, capsys)


def _save_fused(directory: Path, family: str, change=None, **overrides: object) -> None:  # type: ignore[no-untyped-def]
    hf = hf_model(family, **overrides)
    directory.mkdir()
    hf.config.save_pretrained(str(directory))
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if change is not None:
        change(state)
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize(("width", "tensor"), [(16, "gate_up_proj"), (32, "down_proj")])
def test_square_fused_expert_matrix_is_ambiguous(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], width: int, tensor: str
) -> None:
    """2I == H (gate_up_proj [E, 2I, H]) or I == H (down_proj [E, H, I]): a transposed copy has the
    same shape (transformers #47031), so the fused layout is refused rather than guessed."""
    _save_fused(tmp_path / "hf", "mixtral", intermediate_size=width)  # hidden 32
    err = _from_hf_error(tmp_path, capsys)
    assert f"model.layers.0.mlp.experts.{tensor}" in err and "ambiguous" in err


def test_transposed_fused_expert_matrix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def transpose(state: dict[str, torch.Tensor]) -> None:
        state[L0 + "experts.down_proj"] = state[L0 + "experts.down_proj"].transpose(1, 2).contiguous()

    _save_fused(tmp_path / "hf", "qwen2_moe", transpose)
    err = _from_hf_error(tmp_path, capsys)
    assert f"{L0}experts.down_proj has shape [6, 24, 32], expected [6, 32, 24]" in err and "transposed" in err


def _export(tmp_path: Path, family: str) -> tuple[DictSource, ModelSpec, Path]:
    cfg, full = import_state(family, hf_model(family))
    spec = ModelSpec(kind="gpt", cfg=cfg)
    source = DictSource(spec, full)
    export_hf(source, spec, tmp_path / "out", family=family)
    return source, spec, tmp_path / "out"


def test_swapped_experts_are_caught_by_verify(tmp_path: Path) -> None:
    source, spec, out = _export(tmp_path, "mixtral")
    verify_export(source, spec, out, mode="per-layer")  # the faithful export passes

    def swap(state: dict[str, torch.Tensor]) -> None:
        for w in ("w1", "w2", "w3"):
            a, b = (f"model.layers.2.block_sparse_moe.experts.{e}.{w}.weight" for e in (0, 1))
            state[a], state[b] = state[b].clone(), state[a].clone()

    _rewrite(out, swap)
    for mode in ("full", "per-layer"):
        with pytest.raises(UserError, match="first divergence at layer 2") as exc:
            verify_export(source, spec, out, mode=mode)  # type: ignore[arg-type]
        assert "\n" not in str(exc.value)


def test_zeroed_router_is_refused_on_export(tmp_path: Path) -> None:
    cfg, full = import_state("qwen2_moe", hf_model("qwen2_moe"))
    name = "language_model.encoder.layers.2.mlp.router.weight"
    full[name] = torch.zeros_like(full[name])
    spec = ModelSpec(kind="gpt", cfg=cfg)
    with pytest.raises(UserError, match=f"{name} is all zeros"):
        export_hf(DictSource(spec, full), spec, tmp_path / "out", family="qwen2_moe")
    assert not (tmp_path / "out").exists()


def test_router_choices_are_compared() -> None:
    """A rerouted token fails the check unless transformers' own logits nearly tie it."""
    logits = torch.tensor([[3.0, 2.0, 0.0, -1.0], [1.0, 0.5, 0.5 + 1e-7, 0.0]])
    theirs = logits.topk(2, dim=-1).indices  # token 1: experts 0 and 2, expert 1 a hair behind
    assert Routes(ours=[theirs.clone()], theirs=[(theirs, logits)]).check(1e-4) == 1
    near_tie = torch.tensor([[0, 1], [0, 1]])
    assert Routes(ours=[near_tie], theirs=[(theirs, logits)]).check(1e-4) == 1
    wrong = torch.tensor([[0, 2], [0, 2]])
    with pytest.raises(
        UserError, match=r"MoE layer 0 .* routes 1 of 2 probe tokens .*token 0: checkpoint \[0, 2\]"
    ):
        Routes(ours=[wrong], theirs=[(theirs, logits)]).check(1e-4)
    with pytest.raises(UserError, match="routed 0 times, the export 1"):
        Routes(ours=[], theirs=[(theirs, logits)]).check(1e-4)


def _identical_experts_0_and_1(directory: Path) -> None:
    """Layer 0's experts 0 and 1 get the same weights: swapping their router rows then moves no
    logit, only the router's choices."""

    def copy(state: dict[str, torch.Tensor]) -> None:
        for w in ("gate_proj", "up_proj", "down_proj"):
            state[f"{L0}experts.1.{w}.weight"] = state[f"{L0}experts.0.{w}.weight"].clone()

    _rewrite(directory, copy)


def _plant(monkeypatch: pytest.MonkeyPatch, change) -> None:  # type: ignore[no-untyped-def]
    """A converter fault: ``change(model)`` applied to the written (tp 1) checkpoint's tensors."""
    from tools.convert import cli as convert_cli

    convert = convert_cli._convert

    def faulty(args, *rest):  # type: ignore[no-untyped-def]
        rc = convert(args, *rest)
        path = next(Path(args.save).glob("*/mp_rank_00/model_optim_rng.pt"))
        state = torch.load(path, weights_only=False)
        change(state["model"])
        torch.save(state, path)
        return rc

    monkeypatch.setattr(convert_cli, "_convert", faulty)


def _swap_router_rows(model: dict[str, torch.Tensor]) -> None:
    w = model["decoder.layers.0.mlp.router.weight"]
    w[[0, 1]] = w[[1, 0]].clone()


def test_rerouting_fault_is_caught_by_from_hf_and_reshard_verify(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--verify`` on every conversion compares each MoE layer's router choices, not only logits:
    a fault that reroutes tokens between two identical experts keeps the logits but fails, and the
    conversion is removed."""
    save_hf("qwen3_moe", tmp_path / "hf")
    _identical_experts_0_and_1(tmp_path / "hf")
    hf, ck, bad = (str(tmp_path / d) for d in ("hf", "ck", "bad"))
    assert main(["from-hf", "--load", hf, "--save", ck, "--weights-only", "--verify"]) == 0
    assert "router top-k equal in 4 MoE layers" in capsys.readouterr().out
    _plant(monkeypatch, _swap_router_rows)
    for argv in (["from-hf", "--load", hf, "--save", bad, "--weights-only", "--verify"],
                 ["reshard", "--load", ck, "--save", bad, "--target-tp", "1", "--target-pp", "1", "--verify"]):  # fmt: skip
        assert main(argv) == 1, argv
        out = capsys.readouterr()
        assert "max |logit difference|" in out.out  # the logits pass ...
        err = [line for line in out.err.splitlines() if line.startswith("error:")]  # (not the load bars)
        assert len(err) == 2 and "MoE layer 0 (counting MoE layers) routes" in err[0], err  # the routes not
        assert err[1] == f"error: --verify failed; removed {bad}" and not Path(bad).exists()


_EXPERT = "decoder.layers.1.mlp.experts.local_experts.{}.linear_fc{}.weight"


def _swap_experts(model: dict[str, torch.Tensor]) -> None:
    for fc in (1, 2):
        a, b = _EXPERT.format(0, fc), _EXPERT.format(1, fc)
        model[a], model[b] = model[b].clone(), model[a].clone()


def _transpose_square_expert(model: dict[str, torch.Tensor]) -> None:
    name = _EXPERT.format(2, 2)  # [hidden, width] = [32, 32]: the shape cannot tell
    model[name] = model[name].t().contiguous()


def _zero_router(model: dict[str, torch.Tensor]) -> None:
    model["decoder.layers.3.mlp.router.weight"].zero_()


@pytest.mark.parametrize(("fault", "overrides"), [(_swap_experts, {}), (_transpose_square_expert, {"intermediate_size": 32}),
                                                  (_zero_router, {})],
                         ids=["swapped_experts", "square_transposed", "zeroed_router"])  # fmt: skip
def test_expert_faults_that_keep_every_shape_fail_from_hf_verify(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, fault, overrides
) -> None:  # type: ignore[no-untyped-def]
    """Two experts' weights swapped, a square expert matrix transposed or a router zeroed by the
    conversion: every name and shape is right, ``--verify`` (logits) catches it and removes the output."""
    save_hf("mixtral", tmp_path / "hf", **overrides)
    _plant(monkeypatch, fault)
    bad = tmp_path / "bad"
    assert (
        main(["from-hf", "--load", str(tmp_path / "hf"), "--save", str(bad), "--weights-only", "--verify"])
        == 1
    )
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 2 and err[0].startswith("error: --verify: logit differ by"), err
    assert not bad.exists()
