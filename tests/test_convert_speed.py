"""Conversion throughput (issue 29 part 1): the per-tensor paths do no work that scales with the
whole model per tensor, and make no copy the file writer does not need; the files stay the same.

* to-hf converts each layer group as the only layer of a one-layer model (checked against the
  whole-model mapping when planned): the whole-model mapping runs a fixed number of times, not once
  per canonical tensor, and the export is byte for byte the one-group-at-a-time writer's.
* The family mappings and the legacy shard cutter can hand out views (``copy=False``) to writers
  that only read them.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from pretrain.config import ModelConfig
from tests.convert_fixtures import write_ours
from tests.gpt_fixtures import full_weights, tiny_config
from tools.convert_cli import main

os.environ["HF_HUB_OFFLINE"] = "1"
LLAMA = dict(normalization="RMSNorm", swiglu=True, position_embedding_type="rope", add_bias_linear=False,
             num_query_groups=2, untie_embeddings_and_output_weights=True)  # fmt: skip
QWEN2_MOE = {"family": "qwen2_moe"}  # experts in layers 0, 2 and 3 (moe_layer_freq (1, 0, 1, 1))


def _model(overrides: dict[str, object]) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    if "family" in overrides:
        from tests.moe_hf_fixtures import hf_model, import_state

        return import_state(str(overrides["family"]), hf_model(str(overrides["family"])))
    cfg = tiny_config(num_layers=4, **overrides)  # type: ignore[arg-type]
    return cfg, full_weights(cfg)


def _to_hf(ck: Path, save: Path, vocab: int) -> Path:
    argv = ["to-hf", "--weights-only", "--no-verify", "--vocab-size", str(vocab), "--load", str(ck),
            "--save", str(save), "--max-shard-size", "20KB"]  # fmt: skip
    assert main(argv) == 0
    return save


# (a mixture-of-experts export is planned too: its router check skips the dry run's shape probes)
@pytest.mark.slow  # 2.4-15 s on a 2-core host: out of the fast lane (under 2 min)
@pytest.mark.parametrize("overrides", [{}, LLAMA, QWEN2_MOE], ids=["gpt2", "llama", "qwen2-moe"])
def test_to_hf_runs_the_whole_model_mapping_a_fixed_number_of_times(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overrides: dict[str, object]
) -> None:
    """Before: the whole-model mapping (every layer's placeholders) ran for every canonical tensor
    in the plan and again in the stream, so its cost grew as layers x tensors."""
    import tools.hf_io as hf_io
    import tools.hf_plan as hs

    cfg, full = _model(overrides)
    ck = write_ours(tmp_path / "ck", cfg, full, tp=2, pp=1)
    whole: list[int] = []
    real_family = hf_io.export_family_of

    def counting_family(spec, family=None):  # noqa: ANN001, ANN202
        fam = real_family(spec, family)
        module = fam.module()

        class Counting:
            def __getattr__(self, name: str) -> object:
                return getattr(module, name)

            @staticmethod
            def export_tensors(full, cfg, **kw):  # noqa: ANN001, ANN003, ANN205
                if cfg.num_layers > 1:
                    whole.append(1)
                return module.export_tensors(full, cfg, **kw)

        class Fam:
            def __getattr__(self, name: str) -> object:
                return getattr(fam, name)

            def module(self) -> object:
                return Counting()

        return Fam()

    monkeypatch.setattr(hf_io, "export_family_of", counting_family)
    fast = _to_hf(ck, tmp_path / "fast", cfg.vocab_size)
    assert len(whole) <= 3, len(whole)  # the placeholders' outputs, and the rest-group check
    with monkeypatch.context() as m:  # the writer without one-layer groups: the same bytes
        real_plan = hs.plan_hf_tensors
        m.setattr(hs, "plan_hf_tensors", lambda names, metas, convert, layer_convert=None: real_plan(
            names, metas, convert))  # fmt: skip
        slow = _to_hf(ck, tmp_path / "slow", cfg.vocab_size)
    files = sorted(p.name for p in fast.iterdir())
    assert files == sorted(p.name for p in slow.iterdir()) and len(files) > 3
    for f in files:
        assert (fast / f).read_bytes() == (slow / f).read_bytes(), f


def test_a_one_layer_group_that_differs_from_the_whole_model_is_converted_whole() -> None:
    """A one-layer model whose mapping makes other names than the whole model's (here: a mapping
    that numbers its outputs by layer count) is not used: the group is converted with the
    whole-model mapping, and the plan still holds every output once."""
    from tools.hf_plan import plan_hf_tensors

    names = [f"m.layers.{i}.w" for i in range(3)] + ["m.embed"]
    metas = {n: torch.empty(2, 2, device="meta") for n in names}

    def mapping(full: dict[str, torch.Tensor], layers: int) -> dict[str, torch.Tensor]:
        out = {f"hf.{i}.of{layers}.w": full[f"m.layers.{i}.w"] * 1 for i in range(layers)}
        return {**out, "hf.embed": full["m.embed"] * 1}

    plan = plan_hf_tensors(names, metas, lambda full: mapping(full, 3), lambda i: lambda f: mapping(f, 1))
    assert plan is not None
    assert plan.local[:3] == [None, None, None] and plan.local[3] is not None  # names differ; embed same
    assert sorted(t.name for t in plan.tensors) == sorted(mapping(metas, 3))


@pytest.mark.parametrize("overrides", [{}, LLAMA, QWEN2_MOE], ids=["gpt2", "llama", "qwen2-moe"])
def test_family_mappings_hand_out_views_without_copy(overrides: dict[str, object]) -> None:
    from pretrain.checkpoint.plan import ModelSpec
    from tools.hf_io import export_family_of

    cfg, full = _model(overrides)
    module = export_family_of(ModelSpec(kind="gpt", cfg=cfg)).module()
    ptrs = {t.untyped_storage().data_ptr() for t in full.values()}
    copied = module.export_tensors(full, cfg, fresh_heads=())
    viewed = module.export_tensors(full, cfg, fresh_heads=(), copy=False)
    assert copied.keys() == viewed.keys()
    assert all(torch.equal(copied[k], viewed[k]) for k in copied)
    assert not any(t.untyped_storage().data_ptr() in ptrs for t in copied.values())
    shared = [k for k, t in viewed.items() if t.untyped_storage().data_ptr() in ptrs]
    assert len(shared) >= len(viewed) // 2, (len(shared), len(viewed))  # the plain tensors at least


def test_shard_tensor_without_copy_is_a_view_with_the_same_values() -> None:
    from pretrain.models.sharding import RowLayout, shard_tensor

    full = torch.arange(48.0).reshape(8, 6)
    for kw in ({"dim": 0}, {"dim": 1}, {"dim": None}, {"dim": 0, "layout": RowLayout(blocks=2)}):
        for rank in range(2):
            a = shard_tensor(full, tp_rank=rank, tp=2, **kw)  # type: ignore[arg-type]
            b = shard_tensor(full, tp_rank=rank, tp=2, copy=False, **kw)  # type: ignore[arg-type]
            assert torch.equal(a, b) and a.untyped_storage().data_ptr() != full.untyped_storage().data_ptr()
    plain = shard_tensor(full, dim=0, tp_rank=1, tp=2, copy=False)
    assert plain.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()


@pytest.mark.parametrize("overrides", [{}, LLAMA], ids=["gpt2", "llama"])
def test_alike_layers_share_one_dry_run_and_the_plan_is_the_same(overrides: dict[str, object]) -> None:
    """Planning traces one layer of each kind (the one-layer mapping is one object per config) and
    renames it for the others: the same plan as tracing every layer, and a number of one-layer
    dry runs that does not grow with the layers."""
    from pretrain.checkpoint.plan import ModelSpec
    from pretrain.checkpoint.tensor_meta import meta_like
    from tools.hf_io import _export_converters, export_family_of
    from tools.hf_plan import plan_hf_tensors

    def planned(layers: int, shared: bool) -> tuple[object, int]:
        cfg = tiny_config(num_layers=layers, **overrides)  # type: ignore[arg-type]
        spec = ModelSpec(kind="gpt", cfg=cfg)
        convert, layer_convert = _export_converters(export_family_of(spec), spec)
        calls = [0]

        def counted(layer: int):  # noqa: ANN202
            inner = layer_convert(layer)
            assert inner is not None

            def run(chunk):  # noqa: ANN001, ANN202
                calls[0] += 1
                return inner(chunk)

            return run

        cached = {}
        metas = {n: meta_like(t) for n, t in full_weights(cfg).items()}
        plan = plan_hf_tensors(list(metas), metas, convert,
                               lambda i: cached.setdefault(0, counted(i)) if shared else counted(i))  # fmt: skip
        assert plan is not None and all(lg is not None for lg in plan.local)
        return (plan.tensors, plan.groups, [lg.outputs for lg in plan.local]), calls[0]

    for layers in (2, 6):
        shared, traced_once = planned(layers, shared=True)
        every, traced_each = planned(layers, shared=False)
        assert shared == every
        assert traced_each > traced_once
    assert planned(2, shared=True)[1] == planned(6, shared=True)[1]  # flat in the number of layers
