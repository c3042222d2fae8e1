"""LoRA on mixture-of-experts models equals PEFT's LoRA with ``target_parameters`` on transformers'
fused experts (outputs, names, a plain training loop), and the expert adapters shard as the
experts do."""

from __future__ import annotations

import pytest
import torch

from pretrain.models.families.moe_lora import canonical_to_peft, peft_to_canonical
from pretrain.models.lora import LoraConfig, add_lora, lora_parameters
from pretrain.models.sharding import load_full_state_dict
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
