"""SFT from ``--ckpt`` keeps no second copy of the base weights: the decoder's tensors are read from
the checkpoint on access, equal the eager read, and give the same fingerprint."""

from __future__ import annotations

import torch

from finetune.sft.source import load_decoder
from mlm_eval.scoring.megatron import read_gpt_checkpoint
from pretrain.checkpoint.types import SourceTensors


def test_lazy_read_equals_the_eager_read(trained_gpt: dict[str, str]) -> None:
    eager = read_gpt_checkpoint(trained_gpt["ckpt"])
    lazy = read_gpt_checkpoint(trained_gpt["ckpt"], lazy=True)
    assert isinstance(lazy.full, SourceTensors) and isinstance(eager.full, dict)
    assert list(lazy.full) == list(eager.full) and len(lazy.full) == len(eager.full)
    for name, tensor in eager.full.items():
        assert torch.equal(lazy.full[name], tensor), name
    assert lazy.info["fingerprint"] == eager.info["fingerprint"] and lazy.digests == eager.digests
    assert "no.such.tensor" not in lazy.full


def test_sft_decoder_from_a_checkpoint_holds_no_copy_of_the_weights(trained_gpt: dict[str, str]) -> None:
    dec = load_decoder(ckpt=trained_gpt["ckpt"], hf_model=None)
    assert isinstance(dec.tensors, SourceTensors)  # read on access, not a dict of every tensor
    eager = read_gpt_checkpoint(trained_gpt["ckpt"])
    assert dec.fingerprint == eager.info["fingerprint"]
    assert all(torch.equal(dec.tensors[n], t) for n, t in eager.full.items())
