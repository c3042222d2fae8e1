"""The branches taken only on accelerators, run on the CPU by forcing them: they compute the same
function as the CPU branches (the GPU lane, ``tests/test_gpu.py``, runs them for real).

* The logits GEMM over the padded vocabulary rows, columns dropped after it
  (:func:`pretrain.models.language_model.gemm_over_padded_rows`): the same logits, loss and
  gradients, and a zero gradient for the padded rows.
* The cross entropy's backward and the frozen LM head's loss in row blocks of any size
  (:func:`pretrain.tensor_parallel.cross_entropy.block_elements`: 512 MiB on accelerators, a few
  MiB on the CPU): one block, one row per block and a ragged last block all equal
  ``F.cross_entropy``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pretrain.models import language_model, lm_loss
from pretrain.models.gpt import GPTModel
from pretrain.models.sharding import gather_full_state_dict, load_full_state_dict
from pretrain.parallel.state import ParallelState
from pretrain.tensor_parallel import cross_entropy
from pretrain.tensor_parallel.cross_entropy import masked_mean
from tests.gpt_fixtures import batch, full_weights, tiny_config


def _step(cfg, weights, data):
    model = GPTModel(cfg, ParallelState.single(seed=0))
    load_full_state_dict(model, weights)
    logits = model(data["tokens"]).detach()
    loss = masked_mean(model(data["tokens"], labels=data["labels"]), data["loss_mask"])
    loss.backward()
    emb = next(p for n, p in model.named_parameters() if "word_embeddings" in n)
    return logits, loss.detach(), gather_full_state_dict(model, grads=True), emb.grad


def test_logits_over_the_padded_rows_equal_the_cpu_branch(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tiny_config()  # 1003 tokens padded to 1024
    weights, data = full_weights(cfg), batch(cfg)
    want = _step(cfg, weights, data)
    monkeypatch.setattr(language_model, "gemm_over_padded_rows", lambda device: True)
    got = _step(cfg, weights, data)
    assert got[0].shape[-1] == want[0].shape[-1] == cfg.vocab_size
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-6)
    for name, g in want[2].items():
        torch.testing.assert_close(got[2][name], g, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    padded_grad = got[3]  # the parameter's own gradient, padded rows included
    assert padded_grad.shape[0] == 1024 and padded_grad[cfg.vocab_size :].abs().max() == 0


@pytest.mark.parametrize("elements", [1, 7 * 50, 1 << 40])  # one row per block, ragged, one block
def test_cross_entropy_in_row_blocks_of_any_size(monkeypatch: pytest.MonkeyPatch, elements: int) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(23, 50, generator=gen)).requires_grad_()
    target = torch.randint(0, 50, (23,), generator=gen)
    grad = torch.rand(23, generator=gen)
    monkeypatch.setattr(cross_entropy, "block_elements", lambda device, cpu=0: elements)
    monkeypatch.setattr(lm_loss, "block_elements", lambda device, cpu=0: elements)
    ours = cross_entropy.vocab_parallel_cross_entropy(logits, target, vocab_start=0, group=None)
    (g_ours,) = torch.autograd.grad(ours, logits, grad)
    want = F.cross_entropy(logits, target, reduction="none")
    (g_want,) = torch.autograd.grad(want, logits, grad)
    torch.testing.assert_close(ours, want, rtol=0, atol=0)
    torch.testing.assert_close(g_ours, g_want, rtol=0, atol=0)
    hidden = torch.randn(23, 8, generator=gen).requires_grad_()
    weight = torch.randn(50, 8, generator=gen)
    head = lm_loss.lm_head_cross_entropy(hidden, weight, target)
    (gh,) = torch.autograd.grad(head, hidden, grad)
    plain = F.cross_entropy(F.linear(hidden, weight), target, reduction="none")
    (gh_want,) = torch.autograd.grad(plain, hidden, grad)
    torch.testing.assert_close(head, plain, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gh, gh_want, rtol=1e-5, atol=1e-6)


def test_block_sizes_are_small_on_the_cpu_and_large_elsewhere() -> None:
    assert cross_entropy.block_elements(torch.device("cpu")) == 1 << 21
    assert cross_entropy.block_elements(torch.device("cpu"), cpu=5) == 5
    assert cross_entropy.block_elements(torch.device("meta")) == 1 << 27
    assert language_model.gemm_over_padded_rows(torch.device("cpu")) is False
    assert language_model.gemm_over_padded_rows(torch.device("meta")) is True
