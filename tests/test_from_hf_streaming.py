"""mlm-convert from-hf streams: the same files as the in-memory import, in about one rank file of memory.

The Hugging Face directories are written here from seeded tensors (not from a transformers
initialisation), so the digests in :data:`GOLDEN` do not move with a transformers release. They
were computed with the in-memory import (``import_hf`` + ``write_layout``) before from-hf
streamed; the streamed output must keep them, and must be byte for byte the in-memory path's.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tools.convert_cli import main

pytest.importorskip("transformers")

# sha256 over every rank file's tensors (path, dtype, shape, bytes) and the recorded weights
# fingerprint, for ``from-hf --tp 2 --pp 2`` (legacy ``torch`` files), computed before streaming.
GOLDEN = {
    "gpt2": "c8182a698619bd93902786d8f6e384980bc3fac3d2c55533ee66f536f980d8b0",
    "llama_gqa": "2ee2dcbd32b03c5449d3bbc2858185ed4ab9c1db7b51cbaf5919c85a148444db",
    "qwen2": "59f3b04f8e90c05c559a07b02bb7ee85d1606a1b26adf2d88589d70e20ddd0d5",
    "bert": "82bc969c8548b397f25ef67cdde32b03080e0628cd5a8a667a0d9026097bd561",
    "bert_bare": "473e15e025e5e869db98d3b47048769cdf2a85f8abfe2428c230a820c8276a2f",
}


def _config(case: str) -> dict[str, object]:
    """config.json of each case (tiny shapes, every family's fused or tied tensors present)."""
    if case == "gpt2":
        return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 301, "n_positions": 32,
                "n_embd": 32, "n_layer": 4, "n_head": 4, "layer_norm_epsilon": 1e-5, "bos_token_id": 0,
                "eos_token_id": 0}  # fmt: skip
    if case in ("llama_gqa", "qwen2"):
        kind = "llama" if case == "llama_gqa" else "qwen2"
        return {"model_type": kind, "architectures": [f"{kind.capitalize()}ForCausalLM"], "vocab_size": 301,
                "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 4, "num_attention_heads": 4,
                "num_key_value_heads": 2, "max_position_embeddings": 64, "tie_word_embeddings": case == "qwen2",
                "rms_norm_eps": 1e-5, "hidden_act": "silu"}  # fmt: skip
    bare = case == "bert_bare"
    return {"model_type": "bert", "architectures": ["BertModel" if bare else "BertForPreTraining"],
            "vocab_size": 301, "hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
            "intermediate_size": 48, "max_position_embeddings": 32, "layer_norm_eps": 1e-12}  # fmt: skip


def write_hf(directory: Path, case: str) -> Path:
    """A Hugging Face directory of ``case``: config.json and model.safetensors of seeded values
    (shapes from transformers' model on the meta device; tied copies equal to their tie)."""
    import transformers

    config = transformers.AutoConfig.for_model(**_config(case))  # type: ignore[attr-defined]
    arch = getattr(transformers, config.architectures[0])
    with torch.device("meta"):
        model = arch(config)
    gen = torch.Generator().manual_seed(0)
    state = {n: torch.randn(tuple(t.shape), generator=gen) for n, t in sorted(model.state_dict().items())}
    ties = {"lm_head.weight": "transformer.wte.weight", "cls.predictions.decoder.weight":
            "bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.bias": "cls.predictions.bias"}  # fmt: skip
    if case == "qwen2":
        state.pop("lm_head.weight")
    for name, tie in ties.items():
        if name in state and tie in state:
            state[name] = state[tie].clone()
    directory.mkdir(parents=True)
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config.to_json_file(str(directory / "config.json"))
    return directory


def _walk(prefix: str, value: object, out: list[tuple[str, torch.Tensor]]) -> None:
    if isinstance(value, torch.Tensor):
        out.append((prefix, value))
    elif isinstance(value, dict):
        for k in sorted(value, key=str):
            _walk(f"{prefix}/{k}", value[k], out)


def checkpoint_digest(ckpt: Path) -> str:
    """sha256 of the tensors of every rank file (by path) and the recorded weights fingerprint."""
    from pretrain.checkpoint.opener import open_checkpoint

    h = hashlib.sha256()
    for f in sorted(ckpt.rglob("model_optim_rng.pt")):
        tensors: list[tuple[str, torch.Tensor]] = []
        state = torch.load(f, map_location="cpu", weights_only=False)
        _walk(str(f.relative_to(ckpt)), {k: v for k, v in state.items() if k.startswith("model")}, tensors)
        for name, t in tensors:
            t = t.contiguous()
            h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    meta = open_checkpoint(ckpt).metadata
    assert meta is not None
    h.update(str(meta.provenance.weights_fingerprint).encode())
    return h.hexdigest()


def _from_hf(src: Path, save: Path, *extra: str) -> None:
    argv = ["from-hf", "--weights-only", "--load", str(src), "--save", str(save), "--tp", "2", "--pp", "2"]
    assert main([*argv, *extra]) == 0


@pytest.mark.parametrize("case", sorted(GOLDEN))
def test_from_hf_output_keeps_the_in_memory_golden_digest(tmp_path: Path, case: str) -> None:
    _from_hf(write_hf(tmp_path / "hf", case), tmp_path / "ck")
    assert checkpoint_digest(tmp_path / "ck") == GOLDEN[case]
