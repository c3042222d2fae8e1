"""The one reader protocol: in-memory and streamed sources offer ``stored_rows`` and ``with_vocab``
like the checkpoint readers, so writers, export and fingerprint take any of them."""

from __future__ import annotations

import pytest
import torch

from pretrain.checkpoint.types import DictSource, LazySource, TensorSource
from pretrain.utils.errors import UserError
from tests.test_torch_dist_reshard import _source

EMB = "language_model.embedding.word_embeddings.weight"


def test_in_memory_and_lazy_sources_cut_the_vocabulary() -> None:
    src = _source()  # vocab_size 100
    lazy = LazySource(src.spec, {n: (lambda n=n: src.full[n]) for n in src.names()})
    for s in (src, lazy):
        assert isinstance(s, TensorSource)
        view = s.with_vocab(60, source="--tokenizer-dir T")
        assert view.spec.cfg.vocab_size == 60 and s.spec.cfg.vocab_size == 100
        assert torch.equal(view.tensor(EMB), src.full[EMB][:60])
        assert torch.equal(view.stored_rows(EMB), view.tensor(EMB))
        other = next(n for n in src.names() if "layers.0." in n)
        assert torch.equal(view.tensor(other), src.full[other])
    with pytest.raises(UserError, match=r"--tokenizer-dir T: 101 tokens, but the source has 100 rows"):
        DictSource(spec=src.spec, full=src.full).with_vocab(101, source="--tokenizer-dir T")
