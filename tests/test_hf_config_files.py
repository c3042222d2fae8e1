"""An export's ``config.json`` and ``generation_config.json`` made without transformers
(tools.hf_config_files) are byte for byte the files ``AutoConfig.for_model(...).save_pretrained``
and ``GenerationConfig.from_model_config(...).save_pretrained`` write, for every family."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import tools.hf_io as hf_io
from pretrain.checkpoint.plan import ModelSpec
from pretrain.models.families import families, family_of_model_type
from pretrain.utils.errors import UserError
from tests.test_hf_config_json import _model_config, _variants, same_version
from tools.hf_config_files import config_files

transformers = pytest.importorskip("transformers")

SPECIAL_IDS = [{}, {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}, {"bos_token_id": None, "eos_token_id": 5, "pad_token_id": None}]  # fmt: skip
DTYPES = [torch.bfloat16, torch.float32, None]


def _specs(model_type: str, tmp: Path) -> list[ModelSpec]:
    """Our model specs of the hand-written configs of ``model_type`` the converter accepts."""
    family = family_of_model_type(model_type)
    assert family is not None
    specs = []
    for i, raw in enumerate(_variants(model_type)):
        where = tmp / f"v{i}"
        where.mkdir(parents=True)
        (where / "config.json").write_text(__import__("json").dumps(raw))
        cfg = _model_config(transformers.AutoConfig.from_pretrained(str(where)), model_type)
        if isinstance(cfg, str):  # refused: nothing to export
            continue
        try:
            family.module().check_exportable(cfg, family=family)
        except UserError:  # read, but not written back as this family (OLMoE's head_dim)
            continue
        specs.append(ModelSpec(kind=family.kind, cfg=cfg, add_binary_head=family.kind == "bert"))
    bert_bare = [
        dataclasses.replace(s, fresh_heads=("lm_head", "binary_head")) for s in specs[:1] if s.kind == "bert"
    ]
    return specs + bert_bare


def _theirs(
    tmp: Path, model_type: str, spec: ModelSpec, special: dict[str, int | None], dtype: torch.dtype | None
) -> dict[str, bytes]:
    family = family_of_model_type(model_type)
    assert family is not None
    converter = family.module()
    kw = converter.export_config(spec.cfg, family, special_ids=special, fresh_heads=spec.fresh_heads)
    config = transformers.AutoConfig.for_model(model_type, **kw)
    config.dtype = dtype
    tmp.mkdir(parents=True)
    hf_io._write_configs(tmp, config, spec, None)
    return {p.name: p.read_bytes() for p in sorted(tmp.iterdir())}


def _ours(
    model_type: str, spec: ModelSpec, special: dict[str, int | None], dtype: torch.dtype | None
) -> dict[str, bytes]:
    family = family_of_model_type(model_type)
    assert family is not None
    kw = family.module().export_config(spec.cfg, family, special_ids=special, fresh_heads=spec.fresh_heads)
    files = config_files(model_type, kw, dtype=dtype, causal_lm=spec.model_kind.causal_lm)
    assert files is not None
    return {name: text.encode() for name, text in sorted(files.items())}


@same_version
@pytest.mark.parametrize("model_type", [f.model_type for f in families()])
def test_config_files_are_transformers_bytes(model_type: str, tmp_path: Path) -> None:
    specs = _specs(model_type, tmp_path / "cfg")
    assert specs
    n = 0
    for i, spec in enumerate(specs):
        for j, special in enumerate(SPECIAL_IDS):
            for dtype in DTYPES:
                n += 1
                theirs = _theirs(tmp_path / f"t{i}_{j}_{dtype}", model_type, spec, special, dtype)
                assert _ours(model_type, spec, special, dtype) == theirs, (
                    model_type,
                    spec.cfg,
                    special,
                    dtype,
                )
    assert n >= 9


def test_another_transformers_version_leaves_the_files_to_transformers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import tools.hf_config_json as table

    monkeypatch.setattr(table, "installed_version", lambda: "0.0.0")
    assert config_files("llama", {"hidden_size": 8}, dtype=None, causal_lm=True) is None
    assert config_files("t5", {}, dtype=None, causal_lm=True) is None


@same_version
def test_a_weights_only_export_is_the_same_directory_either_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pretrain.checkpoint.opener import open_checkpoint
    from tests.convert_fixtures import write_bf16_llama_torch_dist

    write_bf16_llama_torch_dist(tmp_path / "ck", tp=1, pp=1)
    reader = open_checkpoint(tmp_path / "ck")
    forks: list[object] = []
    real_fork = hf_io.ForkedJob

    def counted(*args: object, **kwargs: object) -> object:
        forks.append(args)
        return real_fork(*args, **kwargs)

    monkeypatch.setattr(hf_io, "ForkedJob", counted)
    hf_io.export_hf(reader, reader.spec, tmp_path / "ours")
    assert forks == []  # no child importing transformers
    monkeypatch.setattr(hf_io, "CONFIG_FILES_WITHOUT_TRANSFORMERS", False)
    hf_io.export_hf(reader, reader.spec, tmp_path / "theirs")
    assert len(forks) == 1
    ours = {p.name: p.read_bytes() for p in (tmp_path / "ours").iterdir()}
    assert ours == {p.name: p.read_bytes() for p in (tmp_path / "theirs").iterdir()}
    assert {"config.json", "generation_config.json"} <= set(ours)


def test_a_refused_export_is_refused_before_any_file(tmp_path: Path) -> None:
    family = family_of_model_type("gpt2")
    assert family is not None
    from tests.gpt_fixtures import tiny_config

    spec = ModelSpec(kind="gpt", cfg=dataclasses.replace(tiny_config(), normalization="RMSNorm"))
    with pytest.raises(UserError):
        hf_io._wrote_config_files(tmp_path, family, spec, None, torch.float32)
    assert list(tmp_path.iterdir()) == []
