"""LoRA on mixture-of-experts models equals PEFT's LoRA with ``target_parameters`` on transformers'
fused experts (outputs, names, a plain training loop), and the expert adapters shard as the
experts do."""

from __future__ import annotations

import pytest
import torch

from pretrain.models.families.moe_lora import canonical_to_peft, peft_to_canonical
from pretrain.models.lora import is_lora_name, lora_parameters, target_of
from pretrain.models.sharding import gather_full_state_dict, load_full_state_dict
from tests.lora_moe_fixtures import LORA, ours_from_hf, peft_model, random_adapters, tiny
from tests.moe_hf_fixtures import probe

pytest.importorskip("peft")

IDS = probe(96)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_logits_equal_peft(family: str) -> None:
    ours, _ = ours_from_hf(family, tiny(family))
    ours.eval()
    adapters = random_adapters(ours)
    load_full_state_dict(ours, adapters, strict=False)
    pm = peft_model(tiny(family), ours.cfg, adapters).eval()
    with torch.no_grad():
        want, got = pm(IDS).logits, ours.full_logits(ours(IDS))
        base = tiny(family)(IDS).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got - base).abs().max() > 1e-2  # the adapters matter


def _batches(n: int, vocab: int = 96) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(11)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (2, 17), generator=gen)
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_three_steps_equal_transformers_peft_loop(family: str) -> None:
    """Same batches, AdamW and LR: the losses and every adapter (attention, each routed expert, the
    shared expert, Qwen's dense layer) after 3 steps agree with PEFT's target_parameters LoRA."""
    import torch.nn.functional as F
    from peft import get_peft_model_state_dict

    ours, _ = ours_from_hf(family, tiny(family))
    ours.train()
    assert not ours.cfg.moe_aux_loss_coeff and not ours.cfg.moe_z_loss_coeff  # HF trains without them
    theirs = peft_model(tiny(family), ours.cfg, None)
    theirs.train()
    start = peft_to_canonical(get_peft_model_state_dict(theirs), ours.cfg, LORA.targets, where="peft")
    load_full_state_dict(ours, start, strict=False)
    # AdamW with eps 1e-6 on both sides: an expert the batch barely routes to has gradients near
    # the default eps 1e-8, where g / (|g| + eps) turns fp32 rounding (~1e-11 there) into a visible
    # part of a step (SGD agrees to 1e-9)
    trainable = [p for p in theirs.parameters() if p.requires_grad]
    opt_ours, opt_theirs = (
        torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01, eps=1e-6)
        for ps in (lora_parameters(ours), trainable)
    )
    assert sum(p.numel() for p in lora_parameters(ours)) == sum(p.numel() for p in trainable)
    for ids, labels in _batches(3):
        loss_ours = ours(ids, labels=labels).mean()
        logits = theirs(ids).logits
        loss_theirs = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        torch.testing.assert_close(loss_ours, loss_theirs, rtol=1e-5, atol=1e-6)
        for opt, loss in ((opt_ours, loss_ours), (opt_theirs, loss_theirs)):
            opt.zero_grad()
            loss.backward()
            opt.step()
    got = {k: v for k, v in gather_full_state_dict(ours).items() if is_lora_name(k)}
    want = peft_to_canonical(get_peft_model_state_dict(theirs), ours.cfg, LORA.targets, where="peft")
    assert got.keys() == want.keys()
    assert any("experts.5.dense_4h_to_h" in k for k in want)
    for name, t in want.items():
        assert "lora_B" not in name or not torch.equal(t, start[name]), name  # every B moved off zero
        # Adam's first steps are ~lr sign(g): an element whose fp32 gradient is ~1e-7 moves by a
        # rounding-sized fraction of lr=1e-2 (seen: <1e-5); SGD agrees to 1e-9
        torch.testing.assert_close(got[name], t, rtol=1e-4, atol=3e-5, msg=name)


def test_peft_names_round_trip_exactly() -> None:
    ours, _ = ours_from_hf("qwen2_moe", tiny("qwen2_moe"))
    adapters = random_adapters(ours)
    for targets in (("qkv", "proj", "fc1", "fc2"), ("fc1",), ("proj", "fc2")):
        mine = {k: v for k, v in adapters.items() if target_of(k) in targets}
        peft = canonical_to_peft(mine, ours.cfg, targets)
        back = peft_to_canonical(peft, ours.cfg, targets, where="x")
        assert back.keys() == mine.keys() and all(torch.equal(back[k], mine[k]) for k in mine)
