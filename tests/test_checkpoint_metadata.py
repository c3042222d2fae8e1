"""The checkpoint's ``args``: Megatron-LM's Namespace with our typed record inside, read through one
function; loaded safely (weights_only with Namespace allow-listed, or the restricted unpickler);
readable by the tools users already have (HF's Megatron GPT-2 converter, Megatron-LM's loader)."""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from pretrain.checkpoint.args import build_metadata
from pretrain.checkpoint.legacy.layout import MODEL_FILE
from pretrain.checkpoint.metadata import read_metadata, to_args
from pretrain.checkpoint.opener import open_checkpoint
from pretrain.checkpoint.safe_unpickle import load_untrusted
from pretrain.checkpoint.types import Provenance, TokenizerRecord
from pretrain.parallel.config import ParallelConfig
from pretrain.utils.errors import UserError
from tests.convert_fixtures import write_ours
from tests.gpt_fixtures import full_weights, tiny_config
from tests.preimported import run_python

CFG = tiny_config(num_layers=3, gelu="tanh")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def full() -> dict[str, torch.Tensor]:
    return full_weights(CFG)


def test_args_is_a_megatron_namespace_with_our_record_inside() -> None:
    tok = TokenizerRecord(tokenizer_type="GPT2BPETokenizer", files=("vocab.json", "merges.txt"), vocab_size=1003,
                          eod=0, probe_ids=(5, 6))  # fmt: skip
    meta = build_metadata(CFG, ParallelConfig(tp=2, pp=2), kind="gpt", tokenizer=tok,
                          provenance=Provenance(global_batch_size=8, data_hash="abc"))  # fmt: skip
    args = to_args(meta, iteration=10)
    assert isinstance(args, argparse.Namespace)
    assert (args.num_layers, args.hidden_size, args.ffn_hidden_size, args.num_attention_heads) == (
        3,
        32,
        128,
        8,
    )
    assert (args.padded_vocab_size, args.vocab_size, args.make_vocab_size_divisible_by) == (1024, 1003, 128)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (2, 2)
    assert args.openai_gelu and not args.apply_residual_connection_post_layernorm
    # tanh GeLU: legacy models read openai_gelu; megatron-core runs tanh only as the fused bias-GeLU
    assert args.bias_gelu_fusion == (meta.module_names == "mcore") and meta.module_names == "mcore"
    assert args.params_dtype == torch.float32 and not args.fp16 and not args.bf16
    assert (args.iteration, args.consumed_train_samples) == (10, 80)
    assert (args.tokenizer_type, args.vocab_file, args.merge_file) == (
        "GPT2BPETokenizer", "tokenizer/vocab.json", "tokenizer/merges.txt")  # fmt: skip
    json.dumps(args.mlm_toolkit)  # our record nested as plain data
    back = read_metadata(args)
    assert back is not None and back.model == CFG and back.parallel == meta.parallel
    assert (
        back.tokenizer == tok and back.provenance.iteration == 10 and back.provenance.consumed_samples == 80
    )
    assert read_metadata(vars(args)) == back  # the restricted unpickler gives a dict: same record


def test_model_config_travels_whole() -> None:
    """Every ModelConfig field (today's and those added later) round-trips through args."""
    import dataclasses

    fields = {f.name for f in dataclasses.fields(CFG)}
    args = to_args(build_metadata(CFG, ParallelConfig(), kind="gpt"))
    assert set(args.mlm_toolkit["model"]) == fields
    broken = dict(args.mlm_toolkit, model={**args.mlm_toolkit["model"], "no_such_field": 1})
    with pytest.raises(UserError, match="no_such_field"):
        read_metadata({"mlm_toolkit": broken}, source="ck")


def test_earlier_dict_args_still_read() -> None:
    """Our earlier checkpoints: args a plain dict with loose mlm_toolkit keys."""
    import dataclasses

    old = {"model_type": "gpt", "num_layers": 3, "mlm_toolkit": {
        "model": dataclasses.asdict(CFG), "parallel": {"tp": 1, "pp": 1, "vp": 1},
        "tokenizer": {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": "/x/vocab.json", "merge_file": "/x/m.txt",
                      "model_path": None},
        "argv": ["gpt"], "converted_from": "/hf"}}  # fmt: skip
    meta = read_metadata(old)
    assert meta is not None and meta.kind == "gpt" and meta.model == CFG
    assert meta.tokenizer is not None and meta.tokenizer.files == ("/x/vocab.json", "/x/m.txt")
    assert meta.provenance.converted_from == "/hf" and meta.module_names == "legacy"


def test_files_load_with_weights_only_and_keep_everything(tmp_path: Path, full) -> None:  # type: ignore[no-untyped-def]
    src = write_ours(tmp_path / "a", CFG, full, tp=2, pp=1, module_names="mcore")
    state = torch.load(src / "iter_0000003/mp_rank_01" / MODEL_FILE, weights_only=True)
    assert isinstance(state["args"], argparse.Namespace) and state["args"].use_mcore_models
    assert "decoder.layers.2.self_attention.linear_qkv.weight" in state["model"]
    assert state["model"]["decoder.layers.2.self_attention.linear_qkv._extra_state"] is None
    reader = open_checkpoint(src)
    assert reader.metadata is not None and reader.metadata.module_names == "mcore"
    for name, t in full.items():
        assert torch.equal(reader.tensor(name), t), name


def _hf_converter_replay(state: dict, config) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def,type-arg]
    """What transformers' ``convert_megatron_gpt2_checkpoint.py`` reads from a legacy file
    (``convert_megatron_checkpoint``), replayed step by step: the config from ``args`` by
    attribute, the nested ``model["language_model"]`` entries, the layer regex and name map,
    and the checkpoint_version >= 2 QKV reordering."""
    ds = state["args"]
    config.vocab_size, config.n_positions = ds.padded_vocab_size, ds.max_position_embeddings
    config.n_embd, config.n_layer, config.n_head = ds.hidden_size, ds.num_layers, ds.num_attention_heads
    config.n_inner = ds.ffn_hidden_size
    config.activation_function = (
        "gelu_fast" if ds.bias_gelu_fusion else "gelu_new" if ds.openai_gelu else "gelu"
    )
    heads, hd = config.n_head, config.n_embd // config.n_head
    lm = state["model"]["language_model"]
    out: dict[str, torch.Tensor] = {}
    wte = lm["embedding"]["word_embeddings"]["weight"][: config.vocab_size]
    out["transformer.wte.weight"] = wte
    out["transformer.wpe.weight"] = lm["embedding"]["position_embeddings"]["weight"]
    assert out["transformer.wpe.weight"].shape[0] == config.n_positions
    transformer = lm["transformer"] if "transformer" in lm else lm["encoder"]
    layer_re = re.compile(r"layers\.(\d+)\.([a-z0-9_.]+)\.([a-z0-9_]+)")
    names = {"attention.dense": ".attn.c_proj.", "self_attention.dense": ".attn.c_proj.",
             "mlp.dense_h_to_4h": ".mlp.c_fc.", "mlp.dense_4h_to_h": ".mlp.c_proj."}  # fmt: skip
    consumed = set()
    for key, val in transformer.items():
        m = layer_re.match(key)
        if m is None:
            continue
        idx, op, wb = int(m.group(1)), m.group(2), m.group(3)
        layer = f"transformer.h.{idx}"
        if op.endswith("layernorm"):
            out[f"{layer}.{'ln_1' if op.startswith('input') else 'ln_2'}.{wb}"] = val
        elif op in ("attention.query_key_value", "self_attention.query_key_value"):
            assert state["checkpoint_version"] >= 2.0
            qkv = val.view(heads, 3, hd, *val.shape[1:]).transpose(0, 1).contiguous().view(val.shape)
            out[f"{layer}.attn.c_attn.{wb}"] = qkv.transpose(0, 1).contiguous() if wb == "weight" else qkv
        elif op in names:
            out[f"{layer}{names[op]}{wb}"] = val.transpose(0, 1) if wb == "weight" else val
        else:
            continue
        consumed.add(key)
    assert config.n_layer == idx + 1
    out["transformer.ln_f.weight"] = transformer["final_layernorm.weight"]
    out["transformer.ln_f.bias"] = transformer["final_layernorm.bias"]
    consumed |= {"final_layernorm.weight", "final_layernorm.bias"}
    assert consumed == set(transformer), set(transformer) - consumed  # every tensor matched
    out["lm_head.weight"] = wte
    return out


def test_hf_megatron_gpt2_converter_reads_our_legacy_file(tmp_path: Path, full) -> None:  # type: ignore[no-untyped-def]
    from transformers import GPT2Config, GPT2LMHeadModel

    from pretrain.models.gpt import GPTModel
    from pretrain.models.sharding import load_full_state_dict
    from pretrain.parallel.state import ParallelState
    from tools.convert_cli import main as convert_main

    src = write_ours(tmp_path / "a", CFG, full, tp=2, pp=1, module_names="mcore")
    dst = tmp_path / "b"  # the converter reads one tp=1 file with the legacy names
    assert convert_main(["reshard", "--load", str(src), "--save", str(dst), "--target-tp", "1", "--target-pp", "1",
                         "--module-names", "legacy"]) == 0  # fmt: skip
    state = torch.load(dst / "iter_0000003/mp_rank_00" / MODEL_FILE, map_location="cpu", weights_only=False)
    config = GPT2Config()
    hf_state = _hf_converter_replay(state, config)
    model = GPT2LMHeadModel(config).eval()
    missing, unexpected = model.load_state_dict(hf_state, strict=False)
    assert not unexpected and not [k for k in missing if not k.endswith((".attn.bias", ".attn.masked_bias"))]
    ours = GPTModel(CFG, ParallelState.single()).eval()
    load_full_state_dict(ours, full)
    x = torch.randint(0, CFG.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = model(x).logits[..., : CFG.vocab_size]
        torch.testing.assert_close(theirs, ours.full_logits(ours(x)), atol=1e-5, rtol=0)


# --- Megatron-LM's load_checkpoint: the args fields and the state keys it reads -------------------
_CHECKED_ARGS = ("num_layers", "hidden_size", "num_attention_heads", "add_position_embedding",
                 "max_position_embeddings", "make_vocab_size_divisible_by", "padded_vocab_size",
                 "tokenizer_type", "tensor_model_parallel_size", "pipeline_model_parallel_size")  # fmt: skip


def test_megatron_load_checkpoint_fields_and_rng_state(tmp_path: Path) -> None:
    """Megatron-LM's load_checkpoint (core_v0.16): ``check_checkpoint_args`` compares these args
    by attribute, reads consumed samples, and restores python/numpy/torch/tracker RNG states."""
    from pretrain.checkpoint.args import checkpoint_args
    from pretrain.checkpoint.legacy.io import save_checkpoint
    from pretrain.models.gpt import GPTModel
    from pretrain.parallel.state import ParallelState

    ps = ParallelState.single()
    save_checkpoint(
        tmp_path, 5, [GPTModel(CFG, ps)], ps, args=checkpoint_args(CFG, ParallelConfig(), model_type="gpt")
    )
    state = torch.load(tmp_path / "iter_0000005/mp_rank_00" / MODEL_FILE, weights_only=True)
    args = state["args"]
    for name in _CHECKED_ARGS:
        getattr(args, name)
    assert getattr(args, "consumed_train_samples", None) == 0 and args.iteration == 5
    rng = state["rng_state"][0]
    for key in ("random_rng_state", "np_rng_state", "torch_rng_state", "rng_tracker_states"):
        assert key in rng, key
    import random

    import numpy as np

    random.setstate(rng["random_rng_state"])
    np.random.set_state(rng["np_rng_state"])  # what Megatron-LM calls, with our stored values
    assert set(state["model"]) >= {"embedding.word_embeddings.weight", "decoder.final_layernorm.weight"}


@pytest.mark.slow
@pytest.mark.parametrize("gelu", ["erf", "tanh"])
def test_megatron_core_gpt_loads_our_file_strictly(tmp_path: Path, full, gelu: str) -> None:  # type: ignore[no-untyped-def]
    """megatron-core's own GPTModel (local spec, built from our args Namespace as Megatron-LM does)
    loads our tp=1 file with ``load_state_dict(strict=True)`` -- every key matched -- and computes
    our logits (tanh GeLU: through the ``bias_gelu_fusion`` our args set for megatron-core names)."""
    pytest.importorskip("megatron.core")
    cfg = tiny_config(num_layers=2, gelu=gelu, vocab_size=100, max_position_embeddings=32)
    weights = full_weights(cfg)
    src = write_ours(tmp_path / "a", cfg, weights, tp=1, pp=1, module_names="mcore")
    script = ROOT / "tests" / "megatron_strict_load.py"
    out = tmp_path / "logits.pt"
    proc = run_python(str(script), [str(src / "iter_0000003/mp_rank_00" / MODEL_FILE), str(out)], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from pretrain.models.gpt import GPTModel
    from pretrain.models.sharding import load_full_state_dict
    from pretrain.parallel.state import ParallelState

    ours = GPTModel(cfg, ParallelState.single()).eval()
    load_full_state_dict(ours, weights)
    probe = torch.load(out)
    with torch.no_grad():
        ref = ours.full_logits(ours(probe["tokens"]))
    # 1e-5: tanh vs exact GeLU moves these logits by ~9e-5, so the wrong GeLU fails
    torch.testing.assert_close(probe["logits"][..., : cfg.vocab_size], ref, atol=1e-5, rtol=0)


# --- the restricted unpickler: real-shaped upstream args of each era ------------------------------
@pytest.fixture(autouse=True)
def _restore_megatron_modules():  # type: ignore[no-untyped-def]
    """The stand-in Megatron modules below replace real ones in ``sys.modules``: put the real ones
    back after each test, so later tests import the installed megatron-core intact."""
    saved = {k: v for k, v in sys.modules.items() if k.startswith("megatron")}
    yield
    for name in [k for k in sys.modules if k.startswith("megatron") and k not in saved]:
        del sys.modules[name]
    sys.modules.update(saved)


def _fake_module(name: str, **members: object) -> types.ModuleType:
    """A stand-in for a Megatron module (so enums pickle under their real qualified names)."""
    mod = types.ModuleType(name)
    for key, value in members.items():
        setattr(mod, key, value)
        getattr(value, "__dict__", {})  # noqa: B018
    sys.modules[name] = mod
    return mod


def _megatron_enum(module: str, name: str, members: dict[str, int]):  # type: ignore[no-untyped-def]
    import enum

    cls = enum.Enum(name, members)
    cls.__module__ = module
    _fake_module(module, **{name: cls})
    return cls


def _core_v016_args() -> argparse.Namespace:
    """The ``vars(args)`` Megatron-LM core_v0.16.1 builds (tests/megatron_lm_args.json) with their
    real value types: ``exit_signal=signal.SIGTERM``, torch dtypes, the AttnBackend enum."""
    raw = json.loads((ROOT / "tests" / "megatron_lm_args.json").read_text())["args"]
    backend = _megatron_enum(
        "megatron.core.transformer.enums", "AttnBackend", {"flash": 1, "fused": 2, "auto": 5}
    )
    ns = argparse.Namespace()
    for key, value in raw.items():
        if isinstance(value, dict) and "__dtype__" in value:
            value = getattr(torch, value["__dtype__"])
        elif isinstance(value, dict) and "__enum__" in value:
            value = backend[value["name"]]
        setattr(ns, key, value)
    ns.exit_signal = signal.SIGTERM
    return ns


def _old_era_args() -> argparse.Namespace:
    """Megatron-LM v2/v3-era args: ``model_type`` enum of megatron.model.enums, fp16, no exit signal."""
    model_type = _megatron_enum("megatron.model.enums", "ModelType", {"encoder_or_decoder": 1})
    return argparse.Namespace(num_layers=3, hidden_size=32, num_attention_heads=8, ffn_hidden_size=128,
                              max_position_embeddings=32, padded_vocab_size=1024, tokenizer_type="GPT2BPETokenizer",
                              model_type=model_type.encoder_or_decoder, params_dtype=torch.half, fp16=True,
                              tensor_model_parallel_size=1, pipeline_model_parallel_size=1)  # fmt: skip


@pytest.mark.parametrize("era", ["core_v0.16", "v3"])
def test_upstream_args_of_each_era_load_as_inert_values(tmp_path: Path, era: str) -> None:
    args = _core_v016_args() if era == "core_v0.16" else _old_era_args()
    path = tmp_path / "model_optim_rng.pt"
    torch.save({"args": args, "iteration": 3, "checkpoint_version": 3.0, "model": {}}, path)
    state = load_untrusted(path)
    loaded = state["args"]
    assert isinstance(loaded, dict) and loaded["num_layers"] == args.num_layers
    if era == "core_v0.16":
        assert loaded["exit_signal"] == signal.SIGTERM and loaded["params_dtype"] == torch.float32
        assert "AttnBackend" in str(loaded["attention_backend"])
    else:
        assert "ModelType" in str(loaded["model_type"]) and loaded["params_dtype"] == torch.float16


class _Evil:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.path}",))


def test_a_pickled_callable_in_args_is_refused_and_never_runs(tmp_path: Path) -> None:
    args = _core_v016_args()
    marker = tmp_path / "pwned"
    args.evil = _Evil(str(marker))
    path = tmp_path / "model_optim_rng.pt"
    torch.save({"args": args, "iteration": 3, "model": {}}, path)
    with pytest.raises(
        UserError, match="unsafe checkpoint file: refusing to unpickle global (posix|os).system"
    ):
        load_untrusted(path)
    assert not marker.exists()
    with pytest.raises(pickle.UnpicklingError):  # and weights_only refuses it too
        torch.load(path, weights_only=True)
    assert not marker.exists()


@pytest.mark.slow  # 2.4-15 s on a 2-core host: out of the fast lane (under 2 min)
def test_engine_core_imports_without_transformers() -> None:
    """pretrain/ (training, checkpoints, tokenizers) imports with transformers unavailable: HF file
    I/O lives at the edge (tools/hf_io.py)."""
    code = """
import importlib, pkgutil, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "transformers" or name.startswith("transformers."):
            raise ImportError("transformers is blocked")
sys.meta_path.insert(0, Block())
import pretrain
for mod in pkgutil.walk_packages(pretrain.__path__, "pretrain."):
    importlib.import_module(mod.name)
assert "transformers" not in sys.modules
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


@pytest.mark.slow
def test_checkpoint_written_by_megatron_core_converts_and_evaluates(tmp_path: Path) -> None:
    """A legacy file megatron-core 0.16 writes with the full core_v0.16 args (exit_signal=SIGTERM,
    AttnBackend, dtypes) naming a GPT-2 BPE: our reader loads it safely, the logits equal
    megatron-core's, and to-hf / mlm-eval use the tokenizer its args name (no tokenizer flags)."""
    pytest.importorskip("megatron.core")
    from mlm_eval.cli import main as eval_main
    from pretrain.models.gpt import GPTModel
    from pretrain.models.sharding import load_full_state_dict
    from pretrain.parallel.state import ParallelState
    from pretrain.tokenizer.train_tiny import train_tiny_gpt2_bpe
    from tools.convert_cli import main as convert_main

    tok = train_tiny_gpt2_bpe(tmp_path / "tok", vocab_size=300)
    vocab = len(json.loads((tok / "vocab.json").read_text()))
    ck = tmp_path / "mcore"
    proc = run_python(str(ROOT / "tests" / "megatron_core_writer.py"),
                      [str(ck), str(tok / "vocab.json"), str(tok / "merges.txt"), str(vocab)], timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    reader = open_checkpoint(ck)
    assert reader.metadata is None and reader.spec.cfg.vocab_size == vocab
    assert reader.info.vocab_source == "args.vocab_size"
    model = GPTModel(reader.spec.cfg, ParallelState.single()).eval()
    load_full_state_dict(model, {n: reader.tensor(n) for n in reader.names()})
    probe = torch.load(ck / "logits.pt")
    with torch.no_grad():
        ours = model.full_logits(model(probe["tokens"]))
    torch.testing.assert_close(ours, probe["logits"], atol=1e-4, rtol=0)
    assert convert_main(["to-hf", "--load", str(ck), "--save", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    out = tmp_path / "r.json"
    assert eval_main(["lambada", "--ckpt", str(ck), "--data", "builtin:lambada_sample.jsonl", "--out", str(out),
                      "--no-progress"]) == 0  # fmt: skip
    record = json.loads(out.read_text())
    assert record["model"]["tokenizer"]["source"] == "args.tokenizer_type GPT2BPETokenizer"


def test_reshard_keeps_rng_state(tmp_path: Path) -> None:
    from pretrain.checkpoint.args import checkpoint_args
    from pretrain.checkpoint.legacy.io import save_checkpoint
    from pretrain.models.gpt import GPTModel
    from pretrain.parallel.state import ParallelState
    from tools.convert_cli import main as convert_main

    ps = ParallelState.single()
    save_checkpoint(
        tmp_path / "a",
        4,
        [GPTModel(CFG, ps)],
        ps,
        args=checkpoint_args(CFG, ParallelConfig(), model_type="gpt"),
    )
    assert convert_main(["reshard", "--load", str(tmp_path / "a"), "--save", str(tmp_path / "b"), "--target-tp", "1",
                         "--target-pp", "1"]) == 0  # fmt: skip
    a = torch.load(tmp_path / "a/iter_0000004/mp_rank_00" / MODEL_FILE, weights_only=True)["rng_state"][0]
    b = torch.load(tmp_path / "b/iter_0000004/mp_rank_00" / MODEL_FILE, weights_only=True)["rng_state"][0]
    assert set(a) == set(b) and torch.equal(a["torch_rng_state"], b["torch_rng_state"])
    assert a["random_rng_state"] == b["random_rng_state"]
