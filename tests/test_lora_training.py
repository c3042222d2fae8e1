"""LoRA training: our first optimizer steps equal a transformers + PEFT loop, and every layout
(TP, PP) equals one process on loss and adapter gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pretrain.models.cpu_gemm import onednn_available
from pretrain.models.families import llama as hf_llama
from pretrain.models.families.llama_lora import peft_to_canonical
from pretrain.models.lora import LoraConfig, add_lora, is_lora_name, lora_parameters
from pretrain.models.sharding import gather_full_state_dict, load_full_state_dict
from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.state import ParallelState
from tests.distributed import run_distributed
from tests.lora_fixtures import LORA, ours_from_hf, peft_model, randomise_adapters, tiny_hf

pytest.importorskip("peft")

TOL = {"rtol": 1e-5, "atol": 1e-6}
CPU_GEMMS = ["mkl", pytest.param("onednn", marks=pytest.mark.skipif(
    not onednn_available(), reason="this PyTorch build has no oneDNN fp32 linear"))]  # fmt: skip
GRAD_TOL = {"rtol": 1e-4, "atol": 1e-5}  # fp32 reduction order; gradients up to ~0.2


def _batches(n: int, vocab: int = 301) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(11)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (2, 17), generator=gen)
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


@pytest.mark.parametrize("library", CPU_GEMMS)
def test_three_steps_equal_transformers_peft_loop(library: str) -> None:
    """Same batches, AdamW and LR: the losses and the adapters after 3 steps agree (fp32), with our
    frozen base GEMMs in MKL (as theirs) or in oneDNN (``--cpu-gemm``)."""
    from peft import get_peft_model_state_dict

    ours = ours_from_hf(tiny_hf("qwen2"), cpu_gemm=library)  # type: ignore[arg-type]
    ours.train()
    theirs = peft_model(tiny_hf("qwen2"), None)
    theirs.train()
    # the same initial adapters: PEFT's random A, copied into ours
    start = peft_to_canonical(get_peft_model_state_dict(theirs), ours.cfg, LORA.targets, where="peft")
    load_full_state_dict(ours, start, strict=False)
    opt_ours = torch.optim.AdamW(lora_parameters(ours), lr=1e-2, weight_decay=0.01)
    opt_theirs = torch.optim.AdamW(
        [p for p in theirs.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01
    )
    assert sum(p.numel() for p in lora_parameters(ours)) == sum(
        p.numel() for p in theirs.parameters() if p.requires_grad
    )
    for ids, labels in _batches(3):
        loss_ours = ours(ids, labels=labels).mean()
        logits = theirs(ids).logits
        loss_theirs = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        torch.testing.assert_close(loss_ours, loss_theirs, **TOL)
        for opt, loss in ((opt_ours, loss_ours), (opt_theirs, loss_theirs)):
            opt.zero_grad()
            loss.backward()
            opt.step()
    got = {k: v for k, v in gather_full_state_dict(ours).items() if is_lora_name(k)}
    want = peft_to_canonical(get_peft_model_state_dict(theirs), ours.cfg, LORA.targets, where="peft")
    for name, t in want.items():
        assert not torch.equal(t, start[name]) or "lora_B" not in name  # B moved off zero
        # atol 2e-5 = 0.2% of one step's lr: Adam's m / sqrt(v) turns an fp32-rounding difference of
        # a near-zero gradient into up to that (one element of 320 in oneDNN's summation order)
        torch.testing.assert_close(got[name], t, rtol=1e-4, atol=2e-5, msg=name)


@pytest.mark.parametrize("case", ["llama3", "qwen2"])  # qwen2: QKV bias
def test_a_bf16_base_step_equals_transformers_peft(case: str) -> None:
    """A bf16 base with fp32 adapters (B of trained size, 0.01): our step (the fused LoRA node and
    the output layer's one pass in bf16) against transformers' bf16 model wrapped by PEFT, whose
    adapters stay fp32: the loss within 1e-5 relative, the adapter gradients within bf16 rounding
    (measured 0.56-0.58% on average, 0.8% at most; our plain path 0.44-0.52%)."""
    from pretrain.models.sharding import gather_full_state_dict

    ours = ours_from_hf(tiny_hf(case), params_dtype="bfloat16").train()
    gen = torch.Generator().manual_seed(5)
    shapes = {k: v.shape for k, v in gather_full_state_dict(ours).items() if is_lora_name(k)}
    adapters = {k: 0.01 * torch.randn(shape, generator=gen) for k, shape in sorted(shapes.items())}
    load_full_state_dict(ours, adapters, strict=False)
    theirs = peft_model(tiny_hf(case).to(torch.bfloat16), adapters).train()
    assert {p.dtype for p in theirs.parameters() if p.requires_grad} == {torch.float32}
    ids = torch.randint(0, 301, (2, 25), generator=torch.Generator().manual_seed(1))
    loss = ours(ids[:, :-1], labels=ids[:, 1:]).mean()
    loss.backward()
    logits = theirs(ids[:, :-1]).logits
    ref = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    ref.backward()
    assert abs(float(loss) - float(ref)) <= 1e-5 * float(ref)
    got = {n: p.grad for n, p in ours.named_parameters() if is_lora_name(n)}
    peft_grads = {
        n.replace(".default", ""): p.grad.float() for n, p in theirs.named_parameters() if p.requires_grad
    }
    want = peft_to_canonical(peft_grads, ours.cfg, LORA.targets, where="peft")
    assert got.keys() == want.keys() and len(got) == 2 * 4 * 2
    rel = {n: float((got[n] - g).norm() / g.norm()) for n, g in want.items()}
    assert max(rel.values()) < 2e-2 and sum(rel.values()) / len(rel) < 1e-2, rel


def _setup(ps: ParallelState, weights, adapters, chunks=None, params_dtype: str = "float32"):
    import dataclasses

    from pretrain.models.gpt import GPTModel

    cfg = dataclasses.replace(hf_llama.model_config_from_hf(tiny_hf().config), params_dtype=params_dtype)
    models = chunks if chunks is not None else [GPTModel(cfg, ps)]
    for m in models:
        load_full_state_dict(m, weights)
        add_lora(m, LORA, seed=3)
        load_full_state_dict(m, adapters, strict=False)
    return models


def _tp_worker(rank: int, world: int, weights, adapters, data):
    ps = ParallelState.from_distributed(ParallelConfig(tp=world), seed=0)
    (model,) = _setup(ps, weights, adapters)
    loss = model(data[0], labels=data[1]).mean()
    loss.backward()
    grads = gather_full_state_dict(model, grads=True)
    return {"loss": loss.detach(), "grads": {k: v for k, v in grads.items() if is_lora_name(k)}}


def _tp_bf16_fast_and_plain_worker(rank: int, world: int, weights, adapters, data):
    """A bf16 base at tp ``world``: loss and adapter gradients with the fused LoRA node, then with
    the plain path (``fast_path_ok`` off), in the same process."""
    from pretrain.models import lora_linear

    ps = ParallelState.from_distributed(ParallelConfig(tp=world), seed=0)
    (model,) = _setup(ps, weights, adapters, params_dtype="bfloat16")
    out = {}
    fused, calls = lora_linear.lora_linear, []
    lora_linear.lora_linear = lambda *a, **k: calls.append(1) or fused(*a, **k)  # a forked worker's module
    for path in ("fast", "plain"):
        if path == "plain":
            lora_linear.fast_path_ok = lambda *_: False
        model.zero_grad(set_to_none=True)
        loss = model(data[0], labels=data[1]).mean()
        loss.backward()
        grads = gather_full_state_dict(model, grads=True)
        out[path] = {"loss": loss.detach().float(), "grads": {k: v for k, v in grads.items() if is_lora_name(k)},
                     "fused_calls": len(calls)}  # fmt: skip
        calls.clear()
    return out


def _pp_worker(rank: int, world: int, weights, adapters, data):
    from pretrain.pipeline.partition import build_model_chunks
    from pretrain.pipeline.schedules import forward_backward

    ps = ParallelState.from_distributed(ParallelConfig(pp=world), seed=0)
    cfg = hf_llama.model_config_from_hf(tiny_hf().config)
    chunks = _setup(ps, weights, adapters, build_model_chunks(cfg, ps))
    n = data[1].numel()
    micro = [{"tokens": data[0][i : i + 1], "labels": data[1][i : i + 1]} for i in range(2)]
    losses, _ = forward_backward(
        chunks=chunks, ps=ps, microbatches=micro, loss_fn=lambda lt, mb: lt.sum() / n, forward_only=False,
    )  # fmt: skip
    grads = {}
    for c in chunks:
        grads.update({k: v for k, v in gather_full_state_dict(c, grads=True).items() if is_lora_name(k)})
    loss = torch.stack(losses).sum() if losses else None
    return {"loss": loss, "grads": grads}


def _reference(weights, adapters, data):
    (model,) = _setup(ParallelState.single(), weights, adapters)
    loss = model(data[0], labels=data[1]).mean()
    loss.backward()
    grads = gather_full_state_dict(model, grads=True)
    return loss.detach(), {k: v for k, v in grads.items() if is_lora_name(k)}


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_layout_equals_one_process(layout: str) -> None:
    hf = tiny_hf()
    cfg = hf_llama.model_config_from_hf(hf.config)
    weights = hf_llama.hf_to_canonical(hf.state_dict(), cfg)
    adapters = randomise_adapters(ours_from_hf(hf, LORA, seed=3))  # B != 0: every A gets a gradient
    data = _batches(1)[0]
    ref_loss, ref_grads = _reference(weights, adapters, data)
    assert all(g.abs().sum() > 0 for g in ref_grads.values())
    worker = _tp_worker if layout == "tp2" else _pp_worker
    results = run_distributed(worker, 2, weights, adapters, data)
    losses = [r["loss"] for r in results if r["loss"] is not None]
    assert losses
    for loss in losses:
        torch.testing.assert_close(loss, ref_loss, **TOL)
    grads = {}
    for r in results:
        if layout == "tp2":
            assert r["grads"].keys() == ref_grads.keys()
        grads.update(r["grads"])
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, **GRAD_TOL, msg=name)


@pytest.mark.slow
def test_bf16_base_at_tp2_fused_node_equals_the_plain_path() -> None:
    """At tp2 with a bf16 base, the fused LoRA node (its all-reduces: the bf16 base input gradient
    and fp32 ``dz`` of the column-parallel linears, the bf16 ``x W^T`` and fp32 ``z`` of the
    row-parallel ones) gives the plain path's loss and adapter gradients on every rank."""
    hf = tiny_hf()
    cfg = hf_llama.model_config_from_hf(hf.config)
    weights = hf_llama.hf_to_canonical(hf.state_dict(), cfg)
    adapters = randomise_adapters(ours_from_hf(hf, LORA, seed=3))
    data = _batches(1)[0]
    for r in run_distributed(_tp_bf16_fast_and_plain_worker, 2, weights, adapters, data):
        fast, plain = r["fast"], r["plain"]
        assert fast["fused_calls"] == 2 * 4 and plain["fused_calls"] == 0  # every adapted linear, then none
        torch.testing.assert_close(fast["loss"], plain["loss"], rtol=1e-6, atol=0.0)
        assert fast["grads"].keys() == plain["grads"].keys() and fast["grads"]
        for name, g in plain["grads"].items():
            assert g.dtype == torch.float32 and g.abs().sum() > 0, name
            assert (fast["grads"][name] - g).norm() / g.norm() < 1e-5, name


def test_layout_independent_init() -> None:
    """A is drawn full from (seed, name) and sliced: the same at tp1 whatever else was created."""
    a = {k: v for k, v in gather_full_state_dict(ours_from_hf(tiny_hf(), seed=9)).items() if "lora_A" in k}
    b = {
        k: v
        for k, v in gather_full_state_dict(ours_from_hf(tiny_hf(seed=4), seed=9)).items()
        if "lora_A" in k
    }
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    c = gather_full_state_dict(ours_from_hf(tiny_hf(), LoraConfig(rank=4, alpha=8.0), seed=10))
    assert not torch.equal(c[next(iter(a))], a[next(iter(a))])


def _dp_worker(rank: int, world: int, weights, adapters, batches, zero1: bool):
    import dataclasses

    from pretrain.distributed import DDPConfig, DistributedDataParallel
    from pretrain.optim import build_optimizer
    from tests.dp_training import OPT, train_pp1

    ps = (
        ParallelState.from_distributed(ParallelConfig(), seed=0)
        if world > 1
        else ParallelState.single(seed=0)
    )
    (model,) = _setup(ps, weights, adapters)
    ddp = DistributedDataParallel(model, ps, DDPConfig(use_distributed_optimizer=zero1))
    opt = build_optimizer(dataclasses.replace(OPT, use_distributed_optimizer=zero1), [ddp], ps)
    steps = train_pp1(ps, model, ddp, opt, batches, num_micro=1)
    full = gather_full_state_dict(model)
    return {"steps": steps, "lora": {k: v for k, v in full.items() if is_lora_name(k)},
            "base": {k: v for k, v in full.items() if not is_lora_name(k)}}  # fmt: skip


@pytest.mark.slow
def test_dp2_zero1_equals_one_process() -> None:
    """3 steps at dp2 with the distributed optimizer (ZeRO-1 over the adapter only) equal one
    process: same adapters; the frozen base never changes."""
    from tests.gpt_fixtures import batch

    hf = tiny_hf()
    cfg = hf_llama.model_config_from_hf(hf.config)
    weights = hf_llama.hf_to_canonical(hf.state_dict(), cfg)
    adapters = randomise_adapters(ours_from_hf(hf, LORA, seed=3))
    batches = [batch(cfg, b=4, s=12, seed=50 + i) for i in range(3)]
    ref = _dp_worker(0, 1, weights, adapters, batches, False)
    for r in run_distributed(_dp_worker, 2, weights, adapters, batches, True):
        assert all(ok for ok, _ in r["steps"])
        for name, v in ref["lora"].items():
            assert not torch.equal(v, adapters[name])
            torch.testing.assert_close(r["lora"][name], v, **TOL, msg=name)
        assert all(torch.equal(r["base"][k], weights[k]) for k in weights)
