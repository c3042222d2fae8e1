"""Memory-lean autograd pieces of the training step (issue 28's LoRA benchmark): the single-rank
cross entropy and the SwiGLU MLP keep less for backward, with values and gradients bitwise those
of plain PyTorch autograd (``F.cross_entropy``; ``F.silu(gate) * up``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from pretrain.config import ModelConfig
from pretrain.models.swiglu import swiglu
from pretrain.models.transformer import ParallelMLP
from pretrain.parallel.state import ParallelState
from pretrain.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy


class _Allocations(TorchDispatchMode):
    """Records the element count of every tensor an op returns in new memory (not a view or an
    in-place result of one of its inputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.numels: list[int] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.numels.append(t.numel())
        return out


@pytest.mark.parametrize("n,v", [(512, 8000), (37, 1000), (5, 7), (3, 300_000)])
def test_cross_entropy_is_bitwise_pytorchs(n: int, v: int) -> None:
    torch.manual_seed(n + v)
    logits = (torch.randn(2, n, v) * 3).requires_grad_()
    target = torch.randint(0, v, (2, n))
    weight = torch.rand(2, n) * (torch.rand(2, n) > 0.3)  # a loss mask and a normalisation
    ref = F.cross_entropy(logits.reshape(-1, v), target.reshape(-1), reduction="none").view(2, n)
    (ref_grad,) = torch.autograd.grad((ref * weight).sum() / 7, logits)
    ours = vocab_parallel_cross_entropy(logits, target, vocab_start=0, group=None)
    (grad,) = torch.autograd.grad((ours * weight).sum() / 7, logits)
    assert torch.equal(ours, ref)
    assert torch.equal(grad, ref_grad)


def test_cross_entropy_backward_allocates_no_logits_sized_tensor() -> None:
    n, v = 1024, 8000  # the LoRA benchmark's batch x sequence and vocabulary
    logits = torch.randn(n, v, requires_grad=True)
    loss = vocab_parallel_cross_entropy(logits, torch.randint(0, v, (n,)), vocab_start=0, group=None)
    with _Allocations() as allocs:
        (grad,) = torch.autograd.grad(loss.mean(), logits)
    # PyTorch's own backward allocates two [n, V] tensors (nll grad, log-softmax grad); ours none
    assert max(allocs.numels) < n * v // 2
    assert grad.shape == (n, v)


def test_cross_entropy_second_backward_is_refused() -> None:
    logits = torch.randn(4, 10, requires_grad=True)
    loss = vocab_parallel_cross_entropy(logits, torch.tensor([1, 2, 3, 4]), vocab_start=0, group=None).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("keep_silu", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_is_bitwise_autograds(dtype: torch.dtype, keep_silu: bool) -> None:
    torch.manual_seed(0)
    y = torch.randn(3, 17, 2 * 40, dtype=dtype, requires_grad=True)
    g = torch.randn(3, 17, 40, dtype=dtype)
    gate, up = y.chunk(2, dim=-1)
    ref = F.silu(gate) * up
    (ref_grad,) = torch.autograd.grad(ref, y, g)
    out = swiglu(y, keep_silu=keep_silu)
    (grad,) = torch.autograd.grad(out, y, g)
    assert torch.equal(out, ref) and torch.equal(grad, ref_grad)


@pytest.mark.parametrize("frozen_fc1", [False, True])
def test_swiglu_mlp_keeps_only_fc1_output_for_the_activation(frozen_fc1: bool) -> None:
    cfg = ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, ffn_hidden_size=24, swiglu=True,
                      add_bias_linear=False, vocab_size=32, max_position_embeddings=8)  # fmt: skip
    mlp = ParallelMLP(cfg, ParallelState.single(device="cpu"))
    for p in mlp.parameters():
        torch.nn.init.normal_(p)
    mlp.dense_h_to_4h.weight.requires_grad_(not frozen_fc1)
    x = torch.randn(2, 8, 16, requires_grad=True)
    params = {p.untyped_storage().data_ptr() for p in mlp.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        mlp(x).sum().backward()
    tokens, f = 2 * 8, 24
    # x (fc1's input, for its weight gradient), fc1's output [gate; up], the activation's output
    # (fc2's input); a frozen fc1 keeps no x but silu(gate) (no weight gradient or optimizer state:
    # memory spent on speed)
    kept = [tokens * 2 * f * 4, tokens * f * 4] + ([tokens * f * 4] if frozen_fc1 else [tokens * 16 * 4])
    assert sorted(saved.values()) == sorted(kept)
