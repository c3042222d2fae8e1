"""Our LoRA equals PEFT's on tiny transformers Llama-family models (outputs, merge, sharding)."""

from __future__ import annotations

import pytest
import torch

from pretrain.models.families import llama as hf_llama
from pretrain.models.families.llama_lora import canonical_to_peft, peft_to_canonical
from pretrain.models.gpt import GPTModel
from pretrain.models.lora import LoraConfig, add_lora, lora_parameters, merged_state
from pretrain.models.sharding import (
    gather_full_state_dict,
    load_full_state_dict,
    row_layout,
    shard_tensor,
    unshard_tensors,
)
from pretrain.parallel.state import ParallelState
from pretrain.utils.errors import UserError
from tests.lora_fixtures import LORA, ours_from_hf, peft_model, randomise_adapters, tiny_hf

pytest.importorskip("peft")

IDS = torch.randint(0, 301, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("case", ["llama3", "qwen2"])
@pytest.mark.parametrize("targets", [("qkv", "proj", "fc1", "fc2"), ("qkv", "fc2")])
def test_logits_equal_peft(case: str, targets: tuple[str, ...]) -> None:
    cfg = LoraConfig(rank=4, alpha=8.0, targets=targets)
    ours = ours_from_hf(tiny_hf(case), cfg).eval()
    adapters = randomise_adapters(ours)
    pm = peft_model(tiny_hf(case), adapters, cfg).eval()
    with torch.no_grad():
        want, got = pm(IDS).logits, ours.full_logits(ours(IDS))
        base = tiny_hf(case)(IDS).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got - base).abs().max() > 1e-2  # the adapters matter


def test_zero_b_is_the_base_and_only_adapters_train() -> None:
    hf = tiny_hf()
    ours = ours_from_hf(hf).eval()
    with torch.no_grad():
        torch.testing.assert_close(ours.full_logits(ours(IDS)), hf(IDS).logits, rtol=1e-5, atol=2e-5)
    trainable = [n for n, p in ours.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    assert len(lora_parameters(ours)) == 2 * 4 * 2


def test_init_matches_peft_distribution_and_shapes() -> None:
    ours = ours_from_hf(tiny_hf())
    full = gather_full_state_dict(ours)
    a = full["language_model.encoder.layers.0.self_attention.query_key_value.lora_A.weight"]
    assert a.shape == (12, 48) and a.abs().max() <= 1 / 48**0.5
    assert full["language_model.encoder.layers.1.mlp.dense_h_to_4h.lora_B.weight"].shape == (160, 4)
    assert not full["language_model.encoder.layers.1.mlp.dense_4h_to_h.lora_B.weight"].any()


def test_query_pruned_forward_keeps_adapters() -> None:
    """Scoring only some positions (query_index) must not bypass the QKV adapter."""
    from pretrain.models.forward_context import ForwardContext

    ours = ours_from_hf(tiny_hf()).eval()
    randomise_adapters(ours)
    index = torch.tensor([[3, 7], [0, 23]])
    with torch.no_grad():
        whole = ours(IDS)
        pruned = ours(IDS, ctx=ForwardContext(query_index=index))
    want = torch.stack([whole[i, index[i]] for i in range(2)])
    torch.testing.assert_close(pruned, want, rtol=1e-5, atol=1e-5)


def test_merged_equals_peft_merge_and_unload() -> None:
    hf = tiny_hf("qwen2")
    ours = ours_from_hf(hf)
    adapters = randomise_adapters(ours)
    mcfg = ours.cfg
    base = hf_llama.hf_to_canonical(hf.state_dict(), mcfg)
    merged = merged_state(base, adapters, mcfg, scaling=LORA.scaling)
    want = peft_model(tiny_hf("qwen2"), adapters).merge_and_unload().state_dict()
    got = hf_llama.canonical_to_hf(merged, mcfg)
    for name, t in got.items():
        torch.testing.assert_close(t, want[name], rtol=1e-6, atol=1e-6, msg=name)
    plain = GPTModel(mcfg, ParallelState.single()).eval()
    load_full_state_dict(plain, merged)
    with torch.no_grad():
        torch.testing.assert_close(plain.full_logits(plain(IDS)), ours.eval().full_logits(ours(IDS)),
                                   rtol=1e-5, atol=1e-5)  # fmt: skip


@pytest.mark.parametrize("tp", [2, 4])
def test_lora_b_shards_follow_the_base_rows(tp: int) -> None:
    """At any TP (GQA groups 2: tp4 replicates k/v) B's rows travel with the base rows they update."""
    cfg = ours_from_hf(tiny_hf()).cfg
    for base_name, rows in (("self_attention.query_key_value", 72), ("mlp.dense_h_to_4h", 160)):
        w = torch.arange(rows, dtype=torch.float32)[:, None].expand(rows, 3)
        b = torch.arange(rows, dtype=torch.float32)[:, None].expand(rows, 4)
        lay_w = row_layout(f"x.{base_name}.weight", cfg)
        lay_b = row_layout(f"x.{base_name}.lora_B.weight", cfg)
        assert lay_w == lay_b and lay_b is not None
        shards = [shard_tensor(b, dim=0, tp_rank=r, tp=tp, layout=lay_b) for r in range(tp)]
        for r, s in enumerate(shards):
            assert torch.equal(s[:, 0], shard_tensor(w, dim=0, tp_rank=r, tp=tp, layout=lay_w)[:, 0])
        assert torch.equal(unshard_tensors(shards, dim=0, layout=lay_b), b)


def test_peft_names_round_trip_exactly() -> None:
    ours = ours_from_hf(tiny_hf())
    adapters = randomise_adapters(ours)
    peft_sd = canonical_to_peft(adapters, ours.cfg, LORA.targets)
    assert "base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight" in peft_sd
    assert peft_sd["base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"].shape == (12, 4)
    back = peft_to_canonical(peft_sd, ours.cfg, LORA.targets, where="x")
    assert back.keys() == adapters.keys()
    assert all(torch.equal(back[k], adapters[k]) for k in back)
    peft_sd.pop("base_model.model.model.layers.0.mlp.up_proj.lora_A.weight")
    with pytest.raises(UserError, match="x: missing tensor .*up_proj.lora_A"):
        peft_to_canonical(peft_sd, ours.cfg, LORA.targets, where="x")


def test_bad_lora_settings_are_one_line() -> None:
    with pytest.raises(UserError, match="--lora-rank"):
        LoraConfig(rank=0, alpha=1.0)
    with pytest.raises(UserError, match="--lora-targets"):
        LoraConfig(rank=2, alpha=1.0, targets=("qkv", "mlp"))
    with pytest.raises(UserError, match="--lora-dropout"):
        LoraConfig(rank=2, alpha=1.0, dropout=1.0)


def test_dropout_only_while_training_and_reproducible() -> None:
    """Dropout on the adapter input: off in eval (then equal to PEFT's eval), the same masks for
    the same seeds (column inputs: default generator; row inputs: the TP-region generator)."""
    cfg = LoraConfig(rank=4, alpha=8.0, dropout=0.3)
    ours = ours_from_hf(tiny_hf(), cfg, ps=ParallelState.single(seed=0))
    adapters = randomise_adapters(ours)
    with torch.no_grad():
        evaluated = ours.eval().full_logits(ours(IDS))
        torch.testing.assert_close(evaluated, peft_model(tiny_hf(), adapters, cfg).eval()(IDS).logits,
                                   rtol=1e-5, atol=1e-5)  # fmt: skip
        ours.train()
        runs = []
        for _ in range(2):
            ours.ps.seed(0)
            runs.append(ours.full_logits(ours(IDS)))
    assert torch.equal(runs[0], runs[1]) and (runs[0] - evaluated).abs().max() > 1e-3


def test_moe_mlp_targets_adapt_the_experts_and_dropout_there_is_refused() -> None:
    """LoRA on MoE MLPs (once refused) adapts each routed expert, never the router; dropout on
    expert adapters is refused as PEFT's target_parameters refuses it."""
    from tests.llama_fixtures import llama_config

    cfg = llama_config(num_experts=4, moe_router_topk=2)
    model = GPTModel(cfg, ParallelState.single())
    with pytest.raises(
        UserError, match="--lora-dropout 0.1 with --lora-targets fc1,fc2 on a mixture-of-experts"
    ):
        add_lora(model, LoraConfig(rank=2, alpha=2.0, dropout=0.1), seed=0)
    add_lora(model, LoraConfig(rank=2, alpha=2.0), seed=0)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(names) == cfg.num_layers * 2 * (2 + 4 * 2)
    assert not any("router" in n for n in names)


@pytest.mark.parametrize("fast", [True, False])
def test_bf16_base_adapted_linear_rounds_as_peft(fast: bool) -> None:
    """A bf16 base with fp32 adapters rounds as PEFT does: the base output upcast, the update added
    in fp32, the sum rounded once to bf16 (our fused node and the plain path alike), and the
    gradients reaching the fp32 adapters equal PEFT's."""
    import torch.nn.functional as F
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    from pretrain.models.lora_linear import lora_linear
    from pretrain.models.lora_ops import add_low_rank

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(64, 48, bias=False)).to(torch.bfloat16)
    pm = get_peft_model(base, PeftLoraConfig(r=4, lora_alpha=8, target_modules=["0"]))
    layer = pm.base_model.model[0]
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    assert a.dtype == b.dtype == torch.float32  # PEFT keeps the adapter in fp32 on a bf16 base
    with torch.no_grad():
        b.normal_(0.0, 0.5)
    w = layer.base_layer.weight.detach()
    x = torch.randn(4, 7, 64).to(torch.bfloat16)
    want = pm(x)
    ours_a, ours_b = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    if fast:
        got = lora_linear(
            x, w, None, ours_a, ours_b, ranges=((0, 48, 0),), scaling=2.0, group=None, column=True
        )
    else:
        got = add_low_rank(F.linear(x, w), F.linear(x.float(), ours_a), ours_b, 2.0)
    assert got.dtype == want.dtype == torch.bfloat16
    assert (got.float() - F.linear(x, w).float()).abs().mean() > 0.1  # the update is not small
    same = (got == want).float().mean().item()
    assert same > 0.995, same  # equal but where fp32 GEMM sums differ in their last bit
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-8, atol=0.0)
    g = torch.randn(want.shape).to(torch.bfloat16)
    ga, gb = torch.autograd.grad(got, (ours_a, ours_b), g)
    ra, rb = torch.autograd.grad(want, (a, b), g)
    torch.testing.assert_close(ga, ra, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gb, rb, rtol=1e-5, atol=1e-6)
