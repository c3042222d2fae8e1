"""A tiny random Llama with the built-in chat tokenizer: the base model of the SFT + LoRA demo.

Written with transformers' own ``LlamaForCausalLM.save_pretrained`` (so it is a Hugging Face model
like any other ``--hf-model``), sized to the tokenizer (~400 tokens), grouped-query attention with
two key/value heads (``--tp 2`` splits them), untied output layer. Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

import torch

from finetune.sft.tiny_tokenizer import write_tiny_chat_tokenizer


def write_tiny_chat_llama(directory: str | Path, *, hidden: int = 64, layers: int = 2, seed: int = 0) -> Path:
    """The tiny chat tokenizer and a random Llama (``hidden``, ``layers``) saved in ``directory``."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = Path(directory)
    tok = AutoTokenizer.from_pretrained(write_tiny_chat_tokenizer(out), local_files_only=True)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)  # fmt: skip
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).save_pretrained(out)
    return out


if __name__ == "__main__":  # python -m finetune.sft.tiny_model DIR (the demo's step writes its base so)
    import sys

    print(write_tiny_chat_llama(sys.argv[1]))
