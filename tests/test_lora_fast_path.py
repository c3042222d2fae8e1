"""The fast paths of a LoRA step compute the plain formulas (values and gradients of autograd over
the plain ops, within fp32 rounding): the fused adapted linear (:mod:`pretrain.models.lora_linear`,
``x W^T + b + s z (block-diagonal B)^T``, alone and inside a model against the plain path it
replaces, taken only where it applies: frozen fp32 base, no dropout while training), the fused
output layer + cross entropy (:mod:`pretrain.models.lm_loss`), the split-and-rotate of QKV
(:func:`pretrain.models.rotary.split_rotate_qkv`) and the frozen RMSNorm's backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pretrain.models import gpt, lm_loss, lora_linear
from pretrain.models.lm_loss import fused_loss_ok, lm_head_cross_entropy
from pretrain.models.lora import is_lora_name
from pretrain.models.lora_linear import fast_path_ok, slice_ranges
from pretrain.models.lora_linear import lora_linear as fused
from pretrain.models.lora_ops import block_diagonal_b, slice_mask
from pretrain.models.norms import RMSNorm
from pretrain.models.rotary import apply_rotary, split_rotate_qkv
from tests.lora_fixtures import ours_from_hf, randomise_adapters, tiny_hf

TOL = {"rtol": 1e-5, "atol": 1e-5}


def _plain(x, w, bias, a, b, mask, s):
    return F.linear(x, w, bias) + s * F.linear(F.linear(x, a), block_diagonal_b(b, mask))


@pytest.mark.parametrize(
    "rows",
    [
        [torch.arange(40)],  # one slice (proj, fc2)
        list(torch.arange(40).chunk(2)),  # SwiGLU fc1: gate, up
        [
            torch.tensor([0, 1, 2, 3, 12, 13, 14, 15]),
            torch.tensor([4, 5, 16, 17]),
            torch.tensor([6, 7, 18, 19]),
        ]
        + [torch.tensor([8, 9, 10, 11])],  # QKV-like interleaved runs, a fourth slice
    ],
)
@pytest.mark.parametrize("bias", [False, True])
def test_fused_equals_plain_formula(rows: list[torch.Tensor], bias: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    out = int(sum(len(r) for r in rows))
    n, r, s = len(rows), 3, 2.5
    x = torch.randn(2, 5, 16, generator=gen, requires_grad=True)
    w, bb = torch.randn(out, 16, generator=gen), torch.randn(out, generator=gen) if bias else None
    a = torch.randn(n * r, 16, generator=gen, requires_grad=True)
    b = torch.randn(out, r, generator=gen, requires_grad=True)
    mask = slice_mask(rows, out, x.device)
    ranges = slice_ranges(mask)
    assert sum(hi - lo for lo, hi, _ in ranges) == out
    got = fused(x, w, bb, a, b, ranges=ranges, scaling=s, group=None, column=True)
    want = _plain(x, w, bb, a, b, mask, s)
    torch.testing.assert_close(got, want, **TOL)
    g = torch.randn(got.shape, generator=gen)
    grads = torch.autograd.grad(got, (x, a, b), g)
    ref = torch.autograd.grad(want, (x, a, b), g)
    for u, v in zip(grads, ref, strict=True):
        torch.testing.assert_close(u, v, **TOL)


def _plain_low_precision(x, w, bias, a, b, mask, s):
    """The plain path with a low-precision base (``LoraColumnParallelLinear``'s fallback), PEFT's
    formula: the base in its dtype, the adapter in fp32 from ``x`` cast, the sum in fp32, rounded once."""
    update = F.linear(F.linear(x.float(), a), block_diagonal_b(b, mask)) * s
    return (F.linear(x, w, bias) + update).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [[torch.arange(40)], list(torch.arange(40).chunk(2)),
                                  [torch.tensor([0, 1, 12, 13]), torch.tensor([2, 3, 14, 15]),
                                   torch.tensor([4, 5, 6, 7, 8, 9, 10, 11, 16, 17, 18, 19])]])  # fmt: skip
@pytest.mark.parametrize("bias", [False, True])
def test_fused_with_a_low_precision_base_equals_the_plain_path(
    rows: list[torch.Tensor], bias: bool, dtype: torch.dtype
) -> None:
    """bf16/fp16 base, fp32 adapters: the output and the input gradient within one rounding of the
    base dtype of the plain path, the adapter gradients (fp32, from the same ``g``) within fp32
    rounding; the update is as large as the base output, so a wrong update would show."""
    gen = torch.Generator().manual_seed(3)
    out, n, r, s = int(sum(len(q) for q in rows)), len(rows), 3, 2.5
    x = torch.randn(2, 5, 16, generator=gen).to(dtype).requires_grad_()
    w = torch.randn(out, 16, generator=gen).to(dtype)
    bb = torch.randn(out, generator=gen).to(dtype) if bias else None
    a = torch.randn(n * r, 16, generator=gen, requires_grad=True)
    b = (0.3 * torch.randn(out, r, generator=gen)).requires_grad_()
    mask = slice_mask(rows, out, x.device)
    got = fused(x, w, bb, a, b, ranges=slice_ranges(mask), scaling=s, group=None, column=True)
    want = _plain_low_precision(x, w, bb, a, b, mask, s)
    assert got.dtype == dtype
    update = (want.float() - F.linear(x, w, bb).float()).abs().mean()
    assert update > 0.3 * want.float().abs().mean()  # the update is not lost in the base's rounding
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(got.float(), want.float(), rtol=eps, atol=eps)
    g = torch.randn(got.shape, generator=gen).to(dtype)
    gx, ga, gb = torch.autograd.grad(got, (x, a, b), g)
    rx, ra, rb = torch.autograd.grad(want, (x, a, b), g)
    assert gx.dtype == dtype and ga.dtype == gb.dtype == torch.float32
    torch.testing.assert_close(gx.float(), rx.float(), rtol=eps, atol=eps)
    torch.testing.assert_close(ga, ra, **TOL)
    torch.testing.assert_close(gb, rb, **TOL)


def test_no_input_gradient_when_the_input_needs_none() -> None:
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    a, b = torch.randn(2, 8, requires_grad=True), torch.randn(6, 2, requires_grad=True)
    y = fused(x, w, None, a, b, ranges=((0, 6, 0),), scaling=1.0, group=None, column=False)
    y.sum().backward()
    assert a.grad is not None and b.grad is not None


def test_fast_path_only_where_it_applies() -> None:
    x, w, a = torch.randn(2, 4), torch.randn(3, 4), torch.randn(1, 4)
    assert fast_path_ok(x, w, None, a, 0.0, True) and fast_path_ok(x, w, None, a, 0.1, False)
    assert not fast_path_ok(x, w, None, a, 0.1, True)  # dropout while training
    assert not fast_path_ok(x, w.requires_grad_(), None, a, 0.0, True)  # a trainable base
    assert fast_path_ok(x.bfloat16(), w.detach().bfloat16(), None, a, 0.0, True)  # bf16 base, fp32 adapter
    assert not fast_path_ok(x.bfloat16(), w.detach().bfloat16(), None, a.bfloat16(), 0.0, True)
    assert not fast_path_ok(x, w.detach().bfloat16(), None, a, 0.0, True)  # input and base differ


def _head_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The rows each call of the fused output layer gets, recorded as it is called."""
    rows: list[int] = []
    apply = lm_loss._LMHeadCrossEntropy.apply
    monkeypatch.setattr(
        lm_loss._LMHeadCrossEntropy, "apply", lambda h, *a: rows.append(h.shape[0]) or apply(h, *a)
    )
    return rows


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(ids[:, :-1], labels=ids[:, 1:]).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if is_lora_name(n)}


@pytest.mark.parametrize("case", ["llama3", "qwen2"])  # qwen2: QKV bias
def test_model_step_equals_the_plain_path(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = ours_from_hf(tiny_hf(case)).train()
    randomise_adapters(model)
    ids = torch.randint(0, 301, (2, 25), generator=torch.Generator().manual_seed(1))
    calls = []
    monkeypatch.setattr(lora_linear, "lora_linear", lambda *a, **k: calls.append(1) or fused(*a, **k))
    monkeypatch.setattr(
        gpt, "lm_head_cross_entropy", lambda *a, **k: calls.append(2) or lm_head_cross_entropy(*a, **k)
    )
    loss, grads = _loss_and_grads(model, ids)
    assert calls == [1] * 2 * 4 + [
        2
    ]  # every adapted linear of both layers, then the head, took the fast path
    monkeypatch.setattr(lora_linear, "fast_path_ok", lambda *_: False)
    monkeypatch.setattr(gpt, "fused_loss_ok", lambda *_: False)
    ref_loss, ref_grads = _loss_and_grads(model, ids)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert grads.keys() == ref_grads.keys() and len(grads) == 2 * 4 * 2
    for name, g in ref_grads.items():
        assert g.abs().sum() > 0, name
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("kept", ["some", "none"])
@pytest.mark.parametrize("path", ["fused", "plain"])  # the frozen head's one pass; logits + cross entropy
def test_model_step_with_a_loss_mask_equals_every_tokens_loss_masked_after(
    path: str, kept: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An SFT batch whose prompts carry no loss: with ``loss_mask`` the output layer sees only the
    loss tokens' rows, and the masked sum and the adapter gradients equal those of every token's
    loss masked after (the same path, without ``loss_mask``)."""
    model = ours_from_hf(tiny_hf("llama3")).train()
    randomise_adapters(model)
    ids = torch.randint(0, 301, (2, 25), generator=torch.Generator().manual_seed(1))
    mask = torch.zeros(2, 24)
    if kept == "some":
        mask[0, 10:], mask[1, 3:7], mask[1, 15:] = 1, 1, 1  # two samples' completions
    rows: list[int] = []
    if path == "plain":
        monkeypatch.setattr(gpt, "fused_loss_ok", lambda *_: False)
        logits = gpt.parallel_lm_logits
        monkeypatch.setattr(gpt, "parallel_lm_logits", lambda h, *a, **k: rows.append(h.shape[:-1].numel()) or logits(h, *a, **k))  # fmt: skip
    else:
        rows = _head_rows(monkeypatch)

    def masked(loss_mask: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        loss = (model(ids[:, :-1], labels=ids[:, 1:], loss_mask=loss_mask) * mask).sum()
        loss.backward()
        grads = {
            n: p.grad.clone() for n, p in model.named_parameters() if is_lora_name(n) and p.grad is not None
        }
        return loss.detach(), grads

    loss, grads = masked(mask)
    assert rows == [int(mask.sum())] == [14 + 4 + 9 if kept == "some" else 0]
    ref_loss, ref_grads = masked(None)
    assert rows[1:] == [2 * 24]
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert len(ref_grads) == 2 * 4 * 2
    for name, g in ref_grads.items():
        assert (g.abs().sum() > 0) == (kept == "some"), name
        torch.testing.assert_close(grads.get(name, torch.zeros_like(g)), g, rtol=1e-4, atol=1e-6, msg=name)


def test_model_step_with_a_bf16_base_takes_the_fast_path_and_equals_the_plain_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bf16 base with fp32 adapters: every adapted linear takes the fused node and the output
    layer its one pass in bf16, and the loss and adapter gradients equal the plain path's up to
    bf16 roundings, and are no further than the plain path's from those of an fp32 output layer.

    The adapted linears round alike (the update added in fp32, the sum rounded once), but their
    fp32 GEMM sums differ in the last bit (the fused node sums each slice's ``r`` products, the
    plain path the block-diagonal ``n r``), and where that straddles a bf16 rounding boundary one
    output is one bf16 ulp off; later layers carry it (1e-7 relative on an AVX-512 Xeon, 1.5e-3 on
    an AVX2 EPYC). The output layer scales ``softmax - onehot`` by the mean's weights after its
    input-gradient GEMM, not before: the gradients move 0.3-1.1% from the plain path's, each
    path 0.6-0.7% on average from the fp32 head's. Rounding the adapters' update to bf16 before
    the add (PEFT does not) moves them 5-23%: the bounds below sit between."""
    model = ours_from_hf(tiny_hf("llama3"), params_dtype="bfloat16").train()
    randomise_adapters(model)
    assert {p.dtype for n, p in model.named_parameters() if is_lora_name(n)} == {torch.float32}
    ids = torch.randint(0, 301, (2, 25), generator=torch.Generator().manual_seed(1))
    calls = []
    monkeypatch.setattr(lora_linear, "lora_linear", lambda *a, **k: calls.append(1) or fused(*a, **k))
    monkeypatch.setattr(
        gpt, "lm_head_cross_entropy", lambda *a, **k: calls.append(2) or lm_head_cross_entropy(*a, **k)
    )
    loss, grads = _loss_and_grads(model, ids)
    assert calls == [1] * 2 * 4 + [2]
    monkeypatch.setattr(lora_linear, "fast_path_ok", lambda *_: False)
    monkeypatch.setattr(gpt, "fused_loss_ok", lambda *_: False)
    ref_loss, ref_grads = _loss_and_grads(model, ids)
    logits = gpt.parallel_lm_logits
    monkeypatch.setattr(gpt, "parallel_lm_logits", lambda x, w, **k: logits(x.float(), w.float(), **k))
    _, fp32_head = _loss_and_grads(model, ids)  # the output layer in fp32: no rounding of its gradient
    torch.testing.assert_close(loss.float(), ref_loss.float(), rtol=1e-5, atol=0.0)
    assert grads.keys() == ref_grads.keys() and len(grads) == 2 * 4 * 2

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    for name, g in ref_grads.items():
        assert g.dtype == torch.float32 and g.abs().sum() > 0, name
        assert rel(grads[name], g) < 2e-2, (name, rel(grads[name], g))
    ours = sum(rel(grads[n], fp32_head[n]) for n in grads) / len(grads)
    plain = sum(rel(ref_grads[n], fp32_head[n]) for n in grads) / len(grads)
    assert ours < 1.2 * plain, (ours, plain)


@pytest.mark.parametrize("block", [1 << 23, 3 * 50])  # one block; blocks of 3 rows (the last short)
def test_lm_head_cross_entropy_equals_plain(block: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lm_loss, "_CPU_BLOCK_ELEMENTS", block)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 7, 16, generator=gen, requires_grad=True)
    w = torch.randn(50, 16, generator=gen)
    t = torch.randint(0, 50, (2, 7), generator=gen)
    got = lm_head_cross_entropy(x, w, t)
    want = F.cross_entropy(F.linear(x, w).flatten(0, 1), t.flatten(), reduction="none").view(2, 7)
    torch.testing.assert_close(got, want, **TOL)
    g = torch.rand(2, 7, generator=gen)  # any per-token weights (a loss mask, a mean)
    (gx,) = torch.autograd.grad(got, x, g)
    (ref,) = torch.autograd.grad(want, x, g)
    torch.testing.assert_close(gx, ref, **TOL)
    with torch.no_grad():
        torch.testing.assert_close(lm_head_cross_entropy(x, w, t), want, **TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block", [1 << 23, 3 * 500])  # one block; blocks of 3 rows (the last short)
def test_lm_head_cross_entropy_in_low_precision_rounds_as_the_plain_path(
    dtype: torch.dtype, block: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bf16/fp16 head: the plain path's logits (the GEMM in that dtype) and fp32 cross entropy,
    so the loss equals it to fp32 rounding; the input gradient, in that dtype, within its rounding
    (the per-row scale applied after the GEMM instead of before: one more rounding)."""
    monkeypatch.setattr(lm_loss, "_CPU_BLOCK_ELEMENTS", block)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 7, 64, generator=gen).to(dtype).requires_grad_()
    w = (0.2 * torch.randn(500, 64, generator=gen)).to(dtype)
    t = torch.randint(0, 500, (2, 7), generator=gen)
    got = lm_head_cross_entropy(x, w, t)
    want = F.cross_entropy(F.linear(x, w).float().flatten(0, 1), t.flatten(), reduction="none").view(2, 7)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    g = torch.rand(2, 7, generator=gen) / 14  # a mean's weights: not powers of two
    (gx,) = torch.autograd.grad(got, x, g)
    (ref,) = torch.autograd.grad(want, x, g)
    assert gx.dtype == dtype
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10  # one rounding of the largest entry
    torch.testing.assert_close(
        gx.float(), ref.float(), rtol=0.0, atol=2 * ulp * float(ref.float().abs().max())
    )
    assert (gx.float() - ref.float()).norm() / ref.float().norm() < 4 * ulp


def test_the_output_layers_one_pass_only_where_it_applies() -> None:
    x, w = torch.ones(3, 4), torch.ones(5, 4)
    assert fused_loss_ok(x, w, 1) and fused_loss_ok(x.bfloat16(), w.bfloat16(), 1)
    assert fused_loss_ok(x.half(), w.half(), 1)
    assert not fused_loss_ok(x, w, 2)  # tensor parallel: the vocab-parallel path
    assert not fused_loss_ok(x, w.requires_grad_(), 1)  # a trained head
    assert not fused_loss_ok(x.bfloat16(), w.detach(), 1)  # dtypes differ
    assert fused_loss_ok(x.to("meta"), w.detach().to("meta"), 1)  # fp32 on any device
    assert not fused_loss_ok(
        x.bfloat16().to("meta"), w.detach().bfloat16().to("meta"), 1
    )  # 16-bit: the CPU only


def test_lm_head_cross_entropy_second_backward_is_refused() -> None:
    x = torch.randn(5, 8, requires_grad=True)
    loss = lm_head_cross_entropy(x, torch.randn(11, 8), torch.tensor([1, 2, 3, 4, 10])).sum()
    loss.backward(retain_graph=True)  # backward scales the kept input gradient in place
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("parts", [(0, 1, 2), (0, 2), (1,)])  # every part, or some without a gradient
def test_split_rotate_qkv_equals_slicing_and_apply_rotary(parts: tuple[int, ...]) -> None:
    b, s, g, qpg, d = 2, 7, 3, 2, 8
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(b, s, g, qpg + 2, d, generator=gen, requires_grad=True)
    angle = torch.rand(1, s, d, generator=gen) * 6  # halves differ: the transpose must pair them right
    cos, sin = angle.cos(), angle.sin()
    got = split_rotate_qkv(qkv, cos, sin)
    q = apply_rotary(qkv[:, :, :, :qpg].reshape(b, s, g * qpg, d), cos, sin)
    want = [t.transpose(1, 2) for t in (q, apply_rotary(qkv[:, :, :, qpg], cos, sin), qkv[:, :, :, qpg + 1])]
    for u, v in zip(got, want, strict=True):
        assert u.is_contiguous()
        torch.testing.assert_close(u, v, rtol=1e-6, atol=1e-6)
    grads = [torch.randn(want[i].shape, generator=gen) for i in parts]
    (gx,) = torch.autograd.grad([got[i] for i in parts], qkv, grads)
    (ref,) = torch.autograd.grad([want[i] for i in parts], qkv, grads)
    torch.testing.assert_close(gx, ref, rtol=1e-6, atol=1e-6)


def test_frozen_rms_norm_equals_the_plain_ops() -> None:
    gen = torch.Generator().manual_seed(4)
    norm = RMSNorm(16, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16, generator=gen))
    x = (3 * torch.randn(2, 5, 16, generator=gen)).requires_grad_()
    want = norm.weight.detach() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    norm.weight.requires_grad_(False)
    got = norm(x)
    assert got.grad_fn is not None and "FrozenRMSNorm" in type(got.grad_fn).__name__
    assert torch.equal(got, want)  # the same forward ops
    g = torch.randn(got.shape, generator=gen)
    (gx,) = torch.autograd.grad(got, x, g)
    (ref,) = torch.autograd.grad(want, x, g)
    torch.testing.assert_close(gx, ref, rtol=1e-5, atol=1e-6)
