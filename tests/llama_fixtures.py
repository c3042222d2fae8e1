"""Tiny random Hugging Face Llama-family models and our matching configs (shared by tests)."""

from __future__ import annotations

from typing import Any

import torch

from pretrain.config import ModelConfig

# GQA 8 query / 2 key-value heads everywhere; one variant per family feature.
HF_CASES: dict[str, dict[str, Any]] = {
    "llama3": dict(
        model_type="llama",
        rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
        },
        tie_word_embeddings=False,
    ),
    "llama_linear_tied": dict(
        model_type="llama", rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        tie_word_embeddings=True,
    ),
    "mistral": dict(model_type="mistral", sliding_window=None, tie_word_embeddings=False),
    "qwen2": dict(model_type="qwen2", rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                  tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", head_dim=12, tie_word_embeddings=False),
}  # fmt: skip


def hf_config(case: str, **overrides: Any) -> Any:
    """A tiny HF config: 2 layers, h=48, 8 heads (2 KV heads), ffn 80, vocab 301."""
    from transformers import AutoConfig

    kw = dict(HF_CASES[case])
    model_type = kw.pop("model_type")
    base = dict(
        vocab_size=301, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, bos_token_id=1,
        eos_token_id=2,
    )  # fmt: skip
    base.update(kw)
    base.update(overrides)
    return AutoConfig.for_model(model_type, **base)


def hf_model(case: str, seed: int = 0, **overrides: Any) -> Any:
    """A random ``*ForCausalLM`` (norm weights and biases perturbed so they matter), eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(case, **overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def llama_config(**overrides: object) -> ModelConfig:
    """Our tiny Llama-style config: RMSNorm, SwiGLU, RoPE, GQA 8/2, untied, no biases."""
    kw: dict[str, object] = dict(
        num_layers=2, hidden_size=32, num_attention_heads=8, num_query_groups=2, vocab_size=1003,
        max_position_embeddings=64, ffn_hidden_size=48, hidden_dropout=0.0, attention_dropout=0.0,
        normalization="RMSNorm", swiglu=True, position_embedding_type="rope", rotary_base=10000.0,
        untie_embeddings_and_output_weights=True, add_bias_linear=False,
    )  # fmt: skip
    kw.update(overrides)
    return ModelConfig(**kw)  # type: ignore[arg-type]


def train_llama_sentencepiece(path: Any, vocab_size: int = 400) -> Any:
    """A tiny Llama-style SentencePiece BPE (unk 0, <s> 1, </s> 2, no pad; byte fallback, identity
    normalisation, dummy prefix) trained on the built-in corpus; written to ``path`` (a .model)."""
    import io
    import json

    import sentencepiece as spm

    from pretrain.data.builtin import builtin_corpus_path

    with open(builtin_corpus_path(), encoding="utf-8") as fh:
        texts = [json.loads(line)["text"] for line in fh if line.strip()]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=buf, vocab_size=vocab_size, model_type="bpe",
        character_coverage=1.0, num_threads=1, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, byte_fallback=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=True,
        split_digits=True, minloglevel=2,
    )  # fmt: skip
    with open(path, "wb") as fh:
        fh.write(buf.getvalue())
    return path


def qwen_style_bpe_tokenizer() -> Any:
    """A Qwen2 tokenizer (byte-level BPE, ~400 tokens, tokenizer.json) trained on the eval samples:
    no BOS, eos = pad = ``<|endoftext|>`` (Qwen2's convention: nothing is added before a document)."""
    import json

    from tokenizers import ByteLevelBPETokenizer
    from transformers import Qwen2Tokenizer

    from tests.eval_helpers import sample_corpus

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        sample_corpus(), vocab_size=400, min_frequency=2, special_tokens=["<|endoftext|>"]
    )
    model = json.loads(bpe._tokenizer.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return Qwen2Tokenizer(vocab=model["vocab"], merges=merges, clean_up_tokenization_spaces=False)


def save_llama_with_tokenizer(directory: Any, tokenizer: Any, case: str = "llama3", **overrides: Any) -> Any:
    """A random ``case`` model sized to ``tokenizer`` (its bos/eos ids) and the tokenizer, saved."""
    model = hf_model(case, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                     eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **overrides)  # fmt: skip
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model
