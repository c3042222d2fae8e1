"""Dry runs on shapes alone (``pretrain.utils.shape_probe``) stand in for torch's
``FakeTensorMode``: the same export plans and tensor shapes for every family, no data read, no
memory, and no ``torch._dynamo`` import (about 2 s of every conversion's start-up before)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pretrain.checkpoint.tensor_meta import meta_like, tensor_meta
from pretrain.utils.shape_probe import ShapeProbe, ShapeProbeMode, shape_of
from tests.gpt_fixtures import full_weights, tiny_config

os.environ["HF_HUB_OFFLINE"] = "1"
LLAMA = dict(normalization="RMSNorm", swiglu=True, position_embedding_type="rope", add_bias_linear=False,
             num_query_groups=2, untie_embeddings_and_output_weights=True)  # fmt: skip


def test_probes_come_out_only_where_no_placeholder_went_in() -> None:
    real = torch.randn(6, 4)
    placeholder = torch.empty(3, 4, device="meta")
    with ShapeProbeMode():
        a = torch.empty(6, 4, dtype=torch.bfloat16)  # a factory makes a probe, never memory
        view = torch.cat([a, a]).view(3, 4, 4).transpose(0, 1).reshape(-1, 4)
        mixed = torch.cat([a.float(), placeholder])
        with_constant = a.float() + real  # a real constant does not taint
        picked = a[torch.tensor([0, 2])]
        q, k = a.split([4, 2])
    assert isinstance(a, ShapeProbe) and a.device.type == "cpu" and a.dtype == torch.bfloat16
    assert isinstance(view, ShapeProbe) and view.shape == (12, 4) and view.is_contiguous() is not False
    assert not isinstance(mixed, ShapeProbe) and mixed.device.type == "meta" and mixed.shape == (9, 4)
    assert isinstance(with_constant, ShapeProbe) and with_constant.dtype == torch.float32
    assert isinstance(picked, ShapeProbe) and picked.shape == (2, 4)
    assert (q.shape, k.shape) == ((4, 4), (2, 4))
    assert "ShapeProbe((6, 4)" in repr(a)
    with pytest.raises(RuntimeError, match="outside its ShapeProbeMode"):
        a + 1  # noqa: B018


def test_values_are_never_read_and_data_dependent_steps_raise(tmp_path: Path) -> None:
    path = tmp_path / "big.bin"
    path.write_bytes(b"\0" * (1 << 20))
    mapped = torch.from_file(str(path), shared=True, size=1 << 18, dtype=torch.float32)
    got = shape_of(lambda: torch.cat([mapped.view(512, 512), mapped.view(512, 512)]).bfloat16().t())
    assert got.device.type == "meta" and got.shape == (512, 1024) and got.dtype == torch.bfloat16
    with pytest.raises(NotImplementedError), ShapeProbeMode():
        x = torch.empty(3)
        torch.equal(x, x)


def _plans(cfg) -> tuple[object, object]:  # noqa: ANN001
    """The export plan of ``cfg`` under the probes, and under torch's FakeTensorMode."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import tools.hf_plan as hp
    from pretrain.checkpoint.plan import ModelSpec
    from tools.hf_io import _export_converters, export_family_of

    spec = ModelSpec(kind="gpt", cfg=cfg)
    metas = {n: meta_like(t) for n, t in full_weights(cfg).items()}

    def plan() -> object:
        convert, layer_convert = _export_converters(export_family_of(spec), spec)
        p = hp.plan_hf_tensors(list(metas), metas, convert, layer_convert)
        assert p is not None
        return p.tensors, p.groups, [None if lg is None else lg.outputs for lg in p.local]

    ours = plan()
    with pytest.MonkeyPatch.context() as m:
        m.setattr(hp, "ShapeProbeMode", lambda: FakeTensorMode(allow_non_fake_inputs=True))
        theirs = plan()
    return ours, theirs


@pytest.mark.parametrize(
    "overrides", [{}, LLAMA, {**LLAMA, "qk_layernorm": True}], ids=["gpt2", "llama", "qk_norm"]
)
def test_the_export_plan_equals_fake_tensor_modes(overrides: dict[str, object]) -> None:
    ours, theirs = _plans(tiny_config(num_layers=3, **overrides))  # type: ignore[arg-type]
    assert ours == theirs


def test_tensor_meta_of_an_hf_import_equals_fake_tensor_modes(tmp_path: Path) -> None:
    """from-hf's source makes each canonical tensor from the mapped HF files (fused QKV, gate/up):
    its shapes come from a dry run, the same as under FakeTensorMode."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tests.lora_fixtures import tiny_hf
    from tools.hf_io import open_hf

    tiny_hf("llama3").save_pretrained(tmp_path / "hf")
    source = open_hf(tmp_path / "hf")
    for name in source.names():
        with FakeTensorMode(allow_non_fake_inputs=True):
            fake = source.tensor(name)
        got = tensor_meta(source, name)
        assert (got.device.type, got.dtype, got.shape) == ("meta", fake.dtype, fake.shape), name
        assert source.meta_cache[name] is got  # asked again (every rank file): not run again


@pytest.mark.slow  # 2.4-15 s on a 2-core host: out of the fast lane (under 2 min)
@pytest.mark.parametrize("family", ["llama3", "qwen2_moe"])
def test_conversions_do_not_import_dynamo(tmp_path: Path, family: str) -> None:
    """from-hf (tensor_meta of the HF import) and to-hf (the plan) run without torch._dynamo."""
    if family == "llama3":
        from tests.lora_fixtures import tiny_hf

        tiny_hf(family).save_pretrained(tmp_path / "hf")
    else:
        from tests.moe_hf_fixtures import save_hf

        save_hf(family, tmp_path / "hf")
    code = (
        "import sys; from tools.convert_cli import main; "
        f"assert main(['from-hf', '--weights-only', '--load', {str(tmp_path / 'hf')!r}, '--save', {str(tmp_path / 'ck')!r}, '--tp', '2']) == 0; "
        f"assert main(['to-hf', '--weights-only', '--no-verify', '--load', {str(tmp_path / 'ck')!r}, '--save', {str(tmp_path / 'back')!r}]) == 0; "
        "print('dynamo' if 'torch._dynamo' in sys.modules else 'clean')"
    )  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False,
                         cwd=Path(__file__).parents[1], env={**os.environ, "HF_HUB_OFFLINE": "1"})  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "clean", (
        out.stdout[-2000:] + out.stderr[-2000:]
    )


@pytest.mark.parametrize(
    ("shapes", "dim"),
    [([(2, 3), (4, 3)], 0), ([(2, 3), (2, 5)], -1), ([(0,), (2, 3)], 0), ([(2, 3, 4)] * 3, 1)],
)
@pytest.mark.parametrize("op", ["cat", "stack"])
def test_cat_and_stack_make_what_torch_makes(shapes: list[tuple[int, ...]], dim: int, op: str) -> None:
    dtypes = [torch.bfloat16, torch.float32, torch.bfloat16][: len(shapes)]
    real = [torch.zeros(s, dtype=d) for s, d in zip(shapes, dtypes, strict=False)]
    try:
        want: torch.Tensor | type[Exception] = getattr(torch, op)(real, dim=dim)
    except RuntimeError:
        want = RuntimeError
    if want is RuntimeError:
        with pytest.raises(RuntimeError):
            shape_of(lambda: getattr(torch, op)(real, dim=dim))
        return
    assert isinstance(want, torch.Tensor)
    got = shape_of(lambda: getattr(torch, op)(real, dim=dim))
    assert (got.shape, got.dtype) == (want.shape, want.dtype)
