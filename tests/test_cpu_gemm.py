"""``--cpu-gemm``: the frozen fp32 base GEMMs on the CPU in MKL or oneDNN compute the same function.

``auto`` resolves from the CPU's vendor alone (oneDNN on x86 CPUs not made by Intel, where MKL
runs its AVX2 kernels); each library's GEMMs, LoRA's fused linear and the frozen output layer
equal the plain float64 formulas within fp32 rounding, the two libraries agree with each other, a
library repeats itself bit for bit (a resume stays bitwise), and ``mlm-finetune sft`` records the
library it ran and refuses one this build lacks.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pretrain.config import ModelConfig
from pretrain.models import cpu_gemm
from pretrain.models.lm_loss import lm_head_cross_entropy
from pretrain.models.lora import is_lora_name
from pretrain.models.lora_linear import lora_linear, slice_ranges
from pretrain.models.lora_ops import block_diagonal_b, slice_mask
from pretrain.utils.errors import UserError
from tests.lora_fixtures import ours_from_hf, randomise_adapters, tiny_hf

LIBRARIES = ["mkl", pytest.param("onednn", marks=pytest.mark.skipif(
    not cpu_gemm.onednn_available(), reason="this PyTorch build has no oneDNN fp32 linear"))]  # fmt: skip


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """``got`` (fp32) equals the float64 ``want`` within fp32 rounding of sums: 2e-6 of its largest
    entry (the GEMMs sum up to 8000 products in their own order)."""
    torch.testing.assert_close(got, want.float(), rtol=0.0, atol=2e-6 * float(want.abs().max()))


@pytest.mark.parametrize(("machine", "vendor", "want"), [
    ("x86_64", "AuthenticAMD", "onednn"), ("x86_64", "HygonGenuine", "onednn"),
    ("x86_64", "GenuineIntel", "mkl"), ("aarch64", None, "mkl"), ("x86_64", None, "mkl"),
])  # fmt: skip
def test_auto_resolves_from_the_cpu_vendor_alone(
    machine: str, vendor: str | None, want: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpu_gemm.platform, "machine", lambda: machine)
    monkeypatch.setattr(cpu_gemm, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(cpu_gemm, "onednn_available", lambda: True)
    assert cpu_gemm.resolve("auto") == want
    assert cpu_gemm.resolve("mkl") == "mkl" and cpu_gemm.resolve("onednn") == "onednn"  # as asked
    monkeypatch.setattr(cpu_gemm, "onednn_available", lambda: False)  # a build without it
    assert cpu_gemm.resolve("auto") == "mkl"


def test_onednn_runs_only_for_fp32_tensors_on_the_cpu() -> None:
    """Elsewhere (a GPU, here the meta device; a bf16 or fp16 base) torch's own matmul runs as
    before, whatever ``auto`` resolved to on the host CPU."""
    x, w = torch.ones(2, 3), torch.ones(4, 3)
    assert cpu_gemm.runs_onednn("onednn", x, w) and not cpu_gemm.runs_onednn("mkl", x, w)
    assert not cpu_gemm.runs_onednn("onednn", x.bfloat16(), w.bfloat16())
    assert not cpu_gemm.runs_onednn("onednn", x.to("meta"), w.to("meta"))


def test_onednn_on_a_build_without_it_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_gemm, "onednn_available", lambda: False)
    with pytest.raises(UserError, match=r"^--cpu-gemm onednn: this PyTorch build has no oneDNN"):
        cpu_gemm.check_available("onednn")
    cpu_gemm.check_available("auto")
    cpu_gemm.check_available("mkl")


def test_the_choice_is_checked_and_not_recorded_as_the_models() -> None:
    cfg = ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2, vocab_size=16, max_position_embeddings=8,
                      cpu_gemm="onednn")  # fmt: skip
    assert cfg.without_memory_options().cpu_gemm == "auto"  # a run's choice, as --fused-kernels
    with pytest.raises(UserError, match="--cpu-gemm must be one of auto, mkl, onednn, got 'blas'"):
        dataclasses.replace(cfg, cpu_gemm="blas")  # type: ignore[arg-type]


@pytest.mark.parametrize("library", LIBRARIES)
@pytest.mark.parametrize(("n", "out", "inp"), [(96, 160, 64), (33, 8000, 64), (1, 48, 200)])
def test_both_gemms_equal_float64_and_repeat_bitwise(library: str, n: int, out: int, inp: int) -> None:
    gen = torch.Generator().manual_seed(0)
    x, w, g = (
        torch.randn(n, inp, generator=gen),
        torch.randn(out, inp, generator=gen),
        torch.randn(n, out, generator=gen),
    )
    bias = torch.randn(out, generator=gen)
    y, gx = cpu_gemm.mm_weight_t(x, w, library), cpu_gemm.mm_weight(g, w, library)  # type: ignore[arg-type]
    _close(y, x.double() @ w.double().t())
    _close(gx, g.double() @ w.double())
    yb = cpu_gemm.mm_weight_t(x, w, library, bias)  # type: ignore[arg-type]
    _close(yb, x.double() @ w.double().t() + bias.double())
    assert torch.equal(y, cpu_gemm.mm_weight_t(x, w, library))  # type: ignore[arg-type]
    assert torch.equal(gx, cpu_gemm.mm_weight(g, w, library))  # type: ignore[arg-type]


@pytest.mark.parametrize("library", LIBRARIES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("slices", [1, 2, 3])  # proj/fc2; SwiGLU fc1; QKV
def test_fused_lora_linear_equals_the_plain_formula(library: str, bias: bool, slices: int) -> None:
    gen = torch.Generator().manual_seed(1)
    out, inp, r, s = 48, 32, 4, 2.0
    rows = list(torch.arange(out).chunk(slices))
    x = torch.randn(3, 7, inp, generator=gen, requires_grad=True)
    w, bb = torch.randn(out, inp, generator=gen), torch.randn(out, generator=gen) if bias else None
    a = torch.randn(slices * r, inp, generator=gen, requires_grad=True)
    b = torch.randn(out, r, generator=gen, requires_grad=True)
    mask = slice_mask(rows, out, x.device)
    got = lora_linear(x, w, bb, a, b, ranges=slice_ranges(mask), scaling=s, group=None, column=True,
                      gemm=library)  # type: ignore[arg-type]  # fmt: skip
    xd, ad, bd = (t.detach().double().requires_grad_() for t in (x, a, b))
    want = F.linear(xd, w.double(), None if bb is None else bb.double())
    want = want + s * F.linear(F.linear(xd, ad), block_diagonal_b(bd, mask.double()))
    _close(got, want)
    g = torch.randn(got.shape, generator=gen)
    for u, v in zip(torch.autograd.grad(got, (x, a, b), g), torch.autograd.grad(want, (xd, ad, bd), g.double()),
                    strict=True):  # fmt: skip
        _close(u, v)


@pytest.mark.parametrize("library", LIBRARIES)
def test_frozen_output_layer_equals_cross_entropy(library: str) -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(300, 32, generator=gen, requires_grad=True)  # 300 rows x V 40000: several row blocks
    w, t = torch.randn(40000, 32, generator=gen), torch.randint(0, 40000, (300,), generator=gen)
    got = lm_head_cross_entropy(x, w, t, gemm=library)  # type: ignore[arg-type]
    xd = x.detach().double().requires_grad_()
    want = F.cross_entropy(xd @ w.double().t(), t, reduction="none")
    _close(got, want)
    g = torch.rand(300, generator=gen)
    (gx,), (ref,) = torch.autograd.grad(got, (x,), g), torch.autograd.grad(want, (xd,), g.double())
    _close(gx, ref)


def _step(library: str) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """Loss, adapter gradients and the number of oneDNN linears run of one LoRA step (2 layers)."""
    model = ours_from_hf(tiny_hf("llama3"), cpu_gemm=library).train()  # type: ignore[arg-type]
    randomise_adapters(model)
    ids = torch.randint(0, 301, (2, 25), generator=torch.Generator().manual_seed(1))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        loss = model(ids[:, :-1], labels=ids[:, 1:]).mean()
        loss.backward()
    onednn = sum(e.count for e in prof.key_averages() if e.key == "mkldnn::_linear_pointwise")
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if is_lora_name(n)}, onednn


@pytest.mark.skipif(not cpu_gemm.onednn_available(), reason="this PyTorch build has no oneDNN fp32 linear")
def test_a_lora_step_is_the_same_in_both_libraries_and_bitwise_in_each() -> None:
    mkl_loss, mkl_grads, none = _step("mkl")
    dnn_loss, dnn_grads, calls = _step("onednn")
    # 2 layers x 4 adapted linears forward and backward (the first QKV's input needs no gradient),
    # the output layer's logits and input gradient in its row blocks
    assert none == 0 and calls == 2 * 4 * 2 - 1 + 2
    torch.testing.assert_close(dnn_loss, mkl_loss, rtol=1e-6, atol=1e-6)
    assert dnn_grads.keys() == mkl_grads.keys() and len(dnn_grads) == 2 * 4 * 2
    for name, g in mkl_grads.items():
        assert g.abs().sum() > 0, name
        torch.testing.assert_close(dnn_grads[name], g, rtol=1e-4, atol=1e-6, msg=name)
    again_loss, again_grads, _ = _step("onednn")  # a resume on the same host runs the same kernels
    assert torch.equal(again_loss, dnn_loss) and all(
        torch.equal(again_grads[n], g) for n, g in dnn_grads.items()
    )


@pytest.mark.parametrize("library", LIBRARIES)
def test_sft_records_the_library_and_its_valid_loss_equals_transformers(
    library: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """LoRA ``--eval-only`` (frozen base: every adapted linear and the head on the fused path)
    equals transformers' assistant-token NLL within 1e-6 relative in either library; a training
    run names the library on its start line."""
    from finetune.cli import main
    from finetune.sft.tiny_tokenizer import SFT_CHAT_FILE
    from tests.sft_fixtures import chat_messages, hf_reference_loss, make_chat_llama

    model = make_chat_llama(tmp_path / "chat_llama")
    want, tokens = hf_reference_loss(model, chat_messages(SFT_CHAT_FILE))
    out = tmp_path / "out"
    assert main(["sft", "--hf-model", str(model), "--data", str(SFT_CHAT_FILE), "--eval-only", "--seq-length", "128",
                 "--lora-rank", "4", "--lora-alpha", "8", "--cpu-gemm", library, "--results-dir", str(out)]) == 0  # fmt: skip
    rec = json.loads((out / "results.json").read_text())
    assert rec["details"]["cpu_gemm"] == library and rec["details"]["lora"]["rank"] == 4
    assert rec["metrics"]["valid_loss_tokens"] == tokens
    assert abs(rec["metrics"]["valid_loss"] - want) <= 1e-6 * want
    capsys.readouterr()
    assert main(["sft", "--hf-model", str(model), "--data", str(SFT_CHAT_FILE), "--seq-length", "128", "--lora-rank", "4",
                 "--lora-alpha", "8", "--cpu-gemm", library, "--global-batch-size", "24", "--micro-batch-size", "24",
                 "--no-progress"]) == 0  # fmt: skip
    assert f"frozen GEMMs in {library} (--cpu-gemm)" in capsys.readouterr().out
