"""``--fused-kernels``: the frozen and the trained RMSNorm and SwiGLU as compiled loops
(:mod:`pretrain.models.fused_kernels`) compute the eager paths' values and gradients (the trained
norm's weight gradient too) within fp32 rounding, also after a new shape (a dynamic recompile); a
full-parameter model step with them equals the eager step and transformers' loss; a LoRA model step with them equals
the eager step and PEFT's on transformers' Llama; checkpoints never record the option; a missing
compiler is refused in one line before any work (``mlm-pretrain``, ``mlm-finetune sft``) and a
failed compilation is one line too; ``mlm-finetune sft --fused-kernels`` at tp2 equals one eager
process (slow: torchrun). Tests that compile are marked slow."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from pretrain.config import ModelConfig
from pretrain.models import fused_kernels
from pretrain.models.gpt import GPTModel
from pretrain.models.lora import is_lora_name
from pretrain.models.norms import RMSNorm
from pretrain.models.swiglu import swiglu
from pretrain.parallel.state import ParallelState
from pretrain.utils.errors import UserError
from tests.lora_fixtures import ours_from_hf, peft_model, randomise_adapters, tiny_hf

SLOW = pytest.mark.slow  # the test compiles kernels (seconds each)


def _norm_out_and_grad(fused: bool, x: torch.Tensor, w: torch.Tensor, g: torch.Tensor):
    norm = RMSNorm(w.numel(), eps=1e-5, fused=fused)
    with torch.no_grad():
        norm.weight.copy_(w)
    norm.weight.requires_grad_(False)
    x = x.clone().requires_grad_()
    y = norm(x)
    assert "FrozenRMSNorm" in type(y.grad_fn).__name__
    (gx,) = torch.autograd.grad(y, x, g)
    return y.detach(), gx


def _swiglu_out_and_grad(fused: bool, y: torch.Tensor, g: torch.Tensor, keep_silu: bool):
    y = y.clone().requires_grad_()
    out = swiglu(y, keep_silu=keep_silu, fused=fused)
    (gy,) = torch.autograd.grad(out, y, g)
    return out.detach(), gy


@SLOW
@pytest.mark.parametrize("shape", [(2, 9), (3, 5)])  # the second shape recompiles (dynamic)
def test_fused_norm_and_swiglu_equal_the_eager_paths(shape: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(sum(shape))
    x, w, g = (
        3 * torch.randn(*shape, 16, generator=gen),
        torch.randn(16, generator=gen),
        torch.randn(*shape, 16, generator=gen),
    )
    for got, want in zip(_norm_out_and_grad(True, x, w, g), _norm_out_and_grad(False, x, w, g), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    y, gy = 2 * torch.randn(*shape, 24, generator=gen), torch.randn(*shape, 12, generator=gen)
    for keep in (False, True):
        want = _swiglu_out_and_grad(False, y, gy, keep)
        for a, b in zip(_swiglu_out_and_grad(True, y, gy, keep), want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert want[1][..., :12].abs().sum() > 0 and want[1][..., 12:].abs().sum() > 0  # gate and up


@SLOW
def test_fused_swiglu_in_bf16_is_within_one_rounding_of_eager() -> None:
    """bf16: the compiled loop keeps fp32 between its ops and rounds once, eager rounds after each."""
    gen = torch.Generator().manual_seed(7)
    y, gy = 2 * torch.randn(3, 5, 24, generator=gen), torch.randn(3, 5, 12, generator=gen)
    y, gy = y.bfloat16(), gy.bfloat16()
    exact = _swiglu_out_and_grad(False, y.double(), gy.double(), False)
    for got, want in zip(_swiglu_out_and_grad(True, y, gy, False), exact, strict=True):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double(), want, rtol=1.6e-2, atol=1e-2)


def _trained_norm(fused: bool, x: torch.Tensor, w: torch.Tensor, g: torch.Tensor):
    norm = RMSNorm(w.numel(), eps=1e-5, fused=fused, dtype=x.dtype)
    with torch.no_grad():
        norm.weight.copy_(w)
    x = x.clone().requires_grad_()
    y = norm(x)
    assert ("TrainedRMSNorm" in type(y.grad_fn).__name__) == fused
    gx, gw = torch.autograd.grad(y, (x, norm.weight), g)
    return y.detach(), gx, gw


@SLOW
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_trained_norm_equals_eager_with_its_weight_gradient(dtype: torch.dtype) -> None:
    """A trained RMSNorm weight (pretraining, full fine-tuning): output, input and weight gradient.
    fp32 within rounding; bf16 within one bf16 rounding of the float64 eager path (the compiled loop
    keeps fp32 between its ops), as close as eager bf16 itself is."""
    gen = torch.Generator().manual_seed(3)
    x, w, g = (
        3 * torch.randn(4, 7, 32, generator=gen),
        1 + torch.randn(32, generator=gen),
        torch.randn(4, 7, 32, generator=gen),
    )
    if dtype == torch.float32:
        for got, want in zip(_trained_norm(True, x, w, g), _trained_norm(False, x, w, g), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        return
    x, w, g = x.to(dtype), w.to(dtype), g.to(dtype)
    exact = _trained_norm(False, x.double(), w.double(), g.double())
    for fused, eager, want in zip(
        _trained_norm(True, x, w, g), _trained_norm(False, x, w, g), exact, strict=True
    ):
        assert fused.dtype == dtype
        fused_err, eager_err = ((t.double() - want).abs().max().item() for t in (fused, eager))
        assert fused_err <= max(2 * eager_err, 1e-2 * want.abs().max().item()), (fused_err, eager_err)


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(ids[:, :-1], labels=ids[:, 1:]).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if is_lora_name(n)}


@SLOW
def test_full_parameter_step_with_fused_kernels_equals_eager_and_transformers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pretraining / full fine-tuning: every norm trains, so the trained-norm loops run (all
    2 * layers + 1 norms), and loss and every gradient equal the eager step's; the loss equals
    transformers' Llama on the same weights."""
    from pretrain.models.families import llama as hf_llama
    from pretrain.models.sharding import load_full_state_dict

    hf = tiny_hf("llama3")
    models = []
    for fused in (False, True):
        cfg = dataclasses.replace(hf_llama.model_config_from_hf(hf.config), fused_kernels=fused)
        model = GPTModel(cfg, ParallelState.single())
        load_full_state_dict(model, hf_llama.hf_to_canonical(hf.state_dict(), cfg))
        models.append(model.train())
    calls: list[str] = []
    kernel = fused_kernels.rms_norm_train_backward
    monkeypatch.setattr(
        fused_kernels, "rms_norm_train_backward", lambda *a: calls.append("norm") or kernel(*a)
    )
    ids = torch.randint(0, 301, (2, 25), generator=torch.Generator().manual_seed(2))
    results = []
    for model in models:
        model.zero_grad(set_to_none=True)
        loss = model(ids[:, :-1], labels=ids[:, 1:]).mean()
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    layers = hf.config.num_hidden_layers
    assert len(calls) == 2 * layers + 1
    (ref_loss, ref_grads), (loss, grads) = results
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert ref_grads.keys() == grads.keys() and any("layernorm" in n for n in grads)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    with torch.no_grad():
        logits = hf.eval()(ids[:, :-1]).logits
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)


@SLOW
def test_lora_model_step_with_fused_kernels_equals_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    hf = tiny_hf("llama3")
    models = [ours_from_hf(hf, fused_kernels=f).train() for f in (False, True)]
    adapters = [randomise_adapters(m) for m in models][0]  # the same values in both (one seed)
    calls: list[str] = []
    for name in ("rms_norm_backward", "swiglu_forward"):
        kernel = getattr(fused_kernels, name)
        monkeypatch.setattr(fused_kernels, name, lambda *a, _k=kernel, _n=name: calls.append(_n) or _k(*a))
    ids = torch.randint(0, 301, (2, 25), generator=torch.Generator().manual_seed(1))
    ref_loss, ref_grads = _loss_and_grads(models[0], ids)
    assert calls == []  # the eager model never calls a compiled kernel
    loss, grads = _loss_and_grads(models[1], ids)
    assert calls.count("swiglu_forward") == 2 and calls.count("rms_norm_backward") == 2 * 2  # the final norm
    # too, not the first (its input, the frozen embedding's output, needs no gradient)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    with torch.no_grad():  # and PEFT on transformers' Llama, with the same adapters, agrees
        logits = peft_model(hf, adapters).eval()(ids[:, :-1]).logits
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    assert grads.keys() == ref_grads.keys() and len(grads) == 2 * 4 * 2
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_checkpoints_never_record_fused_kernels() -> None:
    cfg = ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2, vocab_size=16,
                      max_position_embeddings=8, fused_kernels=True)  # fmt: skip
    assert cfg.without_memory_options().fused_kernels is False


def test_a_compiler_failure_is_one_line_naming_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    class BackendCompilerFailed(RuntimeError):  # what Inductor raises without a C++ compiler
        __module__ = "torch._dynamo.exc"

    def broken(*_a: object, **_k: object):
        def run(*_args: object) -> None:
            raise BackendCompilerFailed("backend='inductor' raised:\nCalledProcessError: g++ not found")

        return run

    @fused_kernels._compiled
    def kernel(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    monkeypatch.setattr(torch, "compile", broken)
    with pytest.raises(UserError, match=r"^--fused-kernels: torch.compile could not build kernel: "
                       r"backend='inductor' raised: \(run without --fused-kernels\)$"):  # fmt: skip
        kernel(torch.zeros(2))


def test_no_compiler_is_refused_before_any_work(
    gpt_data: dict[str, str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from finetune.cli import main as finetune_main
    from pretrain.training.cli import main as pretrain_main
    from tests.cli_helpers import one_line_error
    from tests.train_fixtures import gpt_args

    monkeypatch.setenv("CXX", "no-such-compiler-here")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    want = ("error: --fused-kernels: no C++ compiler 'no-such-compiler-here' on the PATH (torch.compile needs one "
            "for CPU kernels; set CXX or run without --fused-kernels)")  # fmt: skip
    assert one_line_error(pretrain_main, gpt_args(gpt_data, **{"fused-kernels": True}), capsys) == want
    sft = ["sft", "--hf-model", "no-such-dir", "--data", "builtin:sft_chat", "--fused-kernels"]
    assert one_line_error(finetune_main, sft, capsys) == want  # before the model is even looked for


@pytest.mark.slow
def test_sft_fused_kernels_at_tp2_equals_one_eager_process(tmp_path: Path) -> None:
    from finetune.cli import main
    from finetune.sft.tiny_tokenizer import SFT_CHAT_FILE
    from tests.distributed import launch
    from tests.sft_fixtures import make_chat_llama

    model = make_chat_llama(tmp_path / "chat_llama")
    argv = ["sft", "--hf-model", str(model), "--data", str(SFT_CHAT_FILE), "--valid-data", str(SFT_CHAT_FILE),
            "--seq-length", "128", "--pack", "--global-batch-size", "4", "--micro-batch-size", "2", "--lr", "1e-2",
            "--no-progress", "--lora-rank", "4", "--lora-alpha", "8"]  # fmt: skip
    assert main([*argv, "--results-dir", str(tmp_path / "eager")]) == 0
    proc = launch(
        2, "finetune.cli", [*argv, "--tp", "2", "--fused-kernels", "--results-dir", str(tmp_path / "fused")]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    eager, fused = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("eager", "fused"))
    assert (eager["details"]["fused_kernels"], fused["details"]["fused_kernels"]) == (False, True)
    assert fused["details"]["layout"] == "tp2-pp1-dp1"
    torch.testing.assert_close(torch.tensor(fused["details"]["train_losses"]),
                               torch.tensor(eager["details"]["train_losses"]), rtol=1e-5, atol=0)  # fmt: skip
    assert (
        abs(fused["metrics"]["valid_loss"] - eager["metrics"]["valid_loss"])
        <= 1e-5 * eager["metrics"]["valid_loss"]
    )
