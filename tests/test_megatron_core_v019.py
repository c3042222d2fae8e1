"""Checkpoints of megatron-core 0.19 (Megatron-LM core_v0.19.0): read correctly or refused, never misread.

``tests/megatron_lm_args_v019.json`` is the ``vars(args)`` core_v0.19.0's ``parse_args`` +
``validate_args`` produce (see its ``__source__``). Each fact below is listed with its source in
docs/megatron-core-versions.md:

* 0.18 removed the legacy models and ``use_legacy_models``: such args are megatron-core's, whose
  GeLU ignores ``openai_gelu`` (read as legacy they would turn exact GeLU into tanh);
* fields added since 0.16 that change the function (muP, ...) are refused naming the field;
* 0.18 lets ``--padded-vocab-size`` set the rows outright (no padding);
* 0.19's ``torch_dist`` has no ``common.pt``: ``args`` live in the ``common_state`` object inside
  the ``.distcp`` files (tests/megatron_core_v019_writer.py writes such files with megatron-core).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from pretrain import model_options as sem
from pretrain.checkpoint.upstream.args import VocabOptions, true_vocab_size, upstream_model_config
from pretrain.config import ModelConfig
from pretrain.utils.errors import UserError
from tests.preimported import run_python

ROOT = Path(__file__).resolve().parents[1]
ARGS_V019 = Path(__file__).with_name("megatron_lm_args_v019.json")
# fields added after core_v0.16 that change the function (docs/megatron-core-versions.md)
NEW_REFUSED = ["use_mup", "mup_embedding_mult", "mup_output_mult", "hybrid_layer_pattern",
               "mtp_hybrid_override_pattern", "use_grouped_gemm_for_dense_mlp", "gtp_weight_remat_size"]  # fmt: skip


def v019_args(**changes: Any) -> dict[str, Any]:
    """The 0.19 args as our reader sees them (dtypes by name, enums as opaque values)."""
    raw = json.loads(ARGS_V019.read_text())["args"]
    args = {k: (v["__dtype__"] if isinstance(v, dict) and "__dtype__" in v else v) for k, v in raw.items()}
    return {**args, "padded_vocab_size": 256, **changes}


def config_of(args: dict[str, Any]) -> ModelConfig:
    probe = {"x": torch.empty(1)}
    return upstream_model_config(args, probe, kind="gpt", tp=2, vocab_size=100, num_layers=2, source="ckpt")


def test_the_fixture_is_core_v019s() -> None:
    raw = json.loads(ARGS_V019.read_text())
    assert "core_v0.19.0" in raw["__source__"] and "validate_args" in raw["__source__"]
    args = raw["args"]
    assert "use_legacy_models" not in args and "moe_use_legacy_grouped_gemm" not in args  # removed
    assert {"use_mup", "pad_vocab_size", "hybrid_layer_pattern", "gtp_weight_remat_size"} <= set(args)


def test_v019_args_read_as_the_llama_model() -> None:
    cfg = config_of(v019_args())
    assert (cfg.normalization, cfg.swiglu, cfg.position_embedding_type) == ("RMSNorm", True, "rope")
    assert (cfg.query_groups, cfg.ffn_size, cfg.untie_embeddings_and_output_weights) == (2, 96, True)
    assert not cfg.add_bias_linear and not cfg.qkv_bias and cfg.gelu == "erf"


@pytest.mark.parametrize(("changes", "gelu"), [
    (dict(openai_gelu=True), "erf"),  # megatron-core ignores openai_gelu (legacy models ran tanh)
    (dict(onnx_safe=True), "erf"),
    (dict(bias_gelu_fusion=True, add_bias_linear=True), "tanh"),  # the fused bias-GeLU kernel
])  # fmt: skip
def test_v019_args_are_megatron_core_models(changes: dict[str, Any], gelu: str) -> None:
    """0.18+ args lack ``use_legacy_models``: they describe megatron-core models."""
    args = v019_args(swiglu=False, **changes)
    assert sem.is_mcore(args)
    assert config_of(args).gelu == gelu


@pytest.mark.parametrize("field", NEW_REFUSED)
def test_v019_fields_that_change_the_function_are_refused(field: str) -> None:
    allowed = sem.REFUSED[field].harmless
    bad = True if isinstance(allowed[0], bool) else ("M*-" if field.endswith("pattern") else 7)
    with pytest.raises(UserError, match=rf"^ckpt: args\.{field}=") as err:
        config_of(v019_args(**{field: bad}))
    assert "\n" not in str(err.value)
    config_of(v019_args(**{field: allowed[0]}))  # the default reads


def test_v019_unpadded_vocabulary_is_accepted() -> None:
    """``--padded-vocab-size 100`` / ``--no-pad-vocab-size`` (0.18+): rows = tokens, no padding."""
    args = v019_args(vocab_size=None, padded_vocab_size=100, pad_vocab_size=False)
    assert true_vocab_size(args, 100, tp=2, vocab=VocabOptions(size=100), source="ckpt") == (
        100,
        "--vocab-size",
    )
    with pytest.raises(UserError, match="args.padded_vocab_size 100"):
        true_vocab_size(args, 100, tp=2, vocab=VocabOptions(size=60), source="ckpt")


def _write(out: Path, *changes: str) -> None:
    proc = run_python("tests.megatron_core_v019_writer", [str(out), *changes])
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("megatron.core")
    out = tmp_path_factory.mktemp("v019")
    _write(out)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["dist", "legacy"])
def test_v019_checkpoint_reads_with_megatron_cores_logits(written: Path, fmt: str) -> None:
    from pretrain.checkpoint.opener import load_canonical
    from pretrain.checkpoint.verify import ours_probe
    from tests.megatron_core_peer import PROBE

    if fmt == "dist":  # 0.19 layout: args inside the .distcp files
        assert not (written / fmt / "iter_0000001" / "common.pt").exists()
    full, spec, info = load_canonical(written / fmt)
    assert (info.tp, info.padded_vocab_size, spec.cfg.vocab_size, info.ours) == (2, 256, 100, False)
    ref = torch.load(written / "logits.pt")
    assert (ours_probe(full, spec, PROBE) - ref).abs().max().item() < 1e-5


@pytest.mark.slow
def test_v019_checkpoint_with_mup_is_refused_naming_it(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core")
    _write(tmp_path, "use_mup=true")
    for fmt in ("dist", "legacy"):
        proc = subprocess.run([sys.executable, "-m", "tools.convert_cli", "inspect", str(tmp_path / fmt)],
                              cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                              text=True, timeout=300)  # fmt: skip
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and "args.use_mup=True" in lines[0], proc.stderr


@pytest.mark.slow
def test_our_torch_dist_of_it_loads_with_weights_only(written: Path, tmp_path: Path) -> None:
    """megatron-core 0.19 loads a ``common.pt`` with ``torch.load(weights_only=True)`` and its
    allow-list (``Namespace``, ``Signals``, its enums): ours needs nothing beyond ``Namespace``."""

    from pretrain.checkpoint.opener import load_canonical
    from tools.convert_cli import main as convert

    assert convert(["reshard", "--load", str(written / "dist"), "--save", str(tmp_path / "ours"), "--target-tp", "1",
                    "--target-pp", "1", "--ckpt-format", "torch_dist"]) == 0  # fmt: skip
    common = next((tmp_path / "ours").glob("*/common.pt"))
    # In a fresh interpreter that allow-lists Namespace alone (as megatron-core does); here a
    # safe_globals context would also drop, on exit, the Namespace our metadata module allow-lists.
    code = (
        "import argparse, sys, torch; torch.serialization.add_safe_globals([argparse.Namespace]); "
        "print(torch.load(sys.argv[1], weights_only=True)['args'].tensor_model_parallel_size)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(common)], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "1"
    got, _, _ = load_canonical(tmp_path / "ours")
    ref, _, _ = load_canonical(written / "dist")
    assert all(torch.equal(got[n], ref[n]) for n in ref)
