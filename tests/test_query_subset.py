"""The last layer at selected query positions equals the full forward gathered there, for every
family the one model configures (GPT-2, Llama/Mistral, Qwen2/Qwen3, post-LN BERT), under TP."""

from __future__ import annotations

import pytest
import torch

from mlm_eval.scoring.megatron import MegatronGPTScorer
from mlm_eval.scoring.vocab import scored_query_index
from pretrain.models.forward_context import ForwardContext, gather_positions
from pretrain.models.gpt import GPTModel
from pretrain.models.sharding import load_full_state_dict
from pretrain.models.transformer import TransformerBlock
from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.state import ParallelState
from tests.distributed import run_distributed
from tests.gpt_fixtures import full_weights, tiny_config

TOL = {"rtol": 1e-5, "atol": 1e-5}
FAMILIES = {
    "gpt2": {},
    "llama": dict(normalization="RMSNorm", swiglu=True, position_embedding_type="rope", num_query_groups=2,
                  add_bias_linear=False, untie_embeddings_and_output_weights=True),
    "qwen3": dict(normalization="RMSNorm", swiglu=True, position_embedding_type="rope", rotary_percent=0.5,
                  num_query_groups=4, add_bias_linear=False, add_qkv_bias=True, qk_layernorm=True),
}  # fmt: skip
INDEX = torch.tensor([[3, 9, 15, 15], [0, 1, 14, 15], [7, 7, 7, 7]])  # [b, n], padded rows repeat


def _block(cfg, ps: ParallelState, seed: int = 0) -> TransformerBlock:
    block = TransformerBlock(cfg, ps, layer_numbers=range(cfg.num_layers), final_layernorm=True).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen) + (1.0 if p.ndim == 1 else 0.0))
    return block


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_block_at_positions_equals_full_block_gathered(family: str) -> None:
    cfg = tiny_config(**FAMILIES[family])
    block = _block(cfg, ParallelState.single())
    x = torch.randn(3, 16, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = gather_positions(block(x), INDEX)
        pruned = block(x, ForwardContext(query_index=INDEX))
    assert pruned.shape == (3, 4, cfg.hidden_size)
    torch.testing.assert_close(pruned, full, **TOL)


def test_post_ln_bidirectional_block_with_padding_mask() -> None:
    """BERT-style: post-LN, bidirectional attention, a key padding mask ``[b, 1, 1, s]``."""
    cfg = tiny_config(post_layernorm=True, bidirectional=True, num_tokentypes=2)
    block = _block(cfg, ParallelState.single())
    x = torch.randn(3, 16, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    mask = (torch.arange(16)[None, :] < torch.tensor([16, 12, 9])[:, None])[:, None, None, :]
    with torch.no_grad():
        full = gather_positions(block(x, ForwardContext(attn_mask=mask)), INDEX)
        pruned = block(x, ForwardContext(attn_mask=mask, query_index=INDEX))
    torch.testing.assert_close(pruned, full, **TOL)


def test_scored_query_index_lists_the_mask_positions_in_order() -> None:
    mask = torch.zeros(3, 10, dtype=torch.bool)
    mask[0, [7, 8, 9]] = True
    mask[1, [2]] = True
    index, valid = scored_query_index(mask)  # type: ignore[misc]
    assert index.tolist() == [[7, 8, 9], [2, 2, 2], [9, 9, 9]]
    assert valid.tolist() == [[True] * 3, [True, False, False], [False] * 3]
    dense = torch.zeros(3, 10, dtype=torch.bool)
    dense[0, 2:] = True  # 8 of 10 columns: pruning cannot pay
    assert scored_query_index(dense) is None


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_scorer_with_pruned_last_layer_equals_full_log_softmax(family: str) -> None:
    cfg = tiny_config(**FAMILIES[family])
    model = GPTModel(cfg, ParallelState.single())
    load_full_state_dict(model, full_weights(cfg))
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, cfg.vocab_size, (5, 16), generator=gen)
    targets = torch.full((5, 16), -100)
    targets[:, 12:] = torch.randint(0, cfg.vocab_size, (5, 4), generator=gen)
    targets[1, 12:14] = -100  # rows score different numbers of positions
    targets[2, 1:] = torch.randint(0, cfg.vocab_size, (15,), generator=gen)  # a dense row: run in full
    out = MegatronGPTScorer(model, batch_size=2).score(ids, targets)
    with torch.no_grad():
        logp = torch.log_softmax(model.full_logits(model(ids)).double(), dim=-1)
    mask = targets >= 0
    want = -logp[mask].gather(1, targets[mask][:, None])[:, 0]
    torch.testing.assert_close(out.nll[mask], want, rtol=1e-5, atol=1e-5)


def _tp_block(rank: int, world: int, cfg, x: torch.Tensor):
    ps = ParallelState.from_distributed(ParallelConfig(tp=world), seed=0)
    single = _block(cfg, ParallelState.single())
    block = TransformerBlock(cfg, ps, layer_numbers=range(cfg.num_layers), final_layernorm=True).eval()
    model = GPTModel(cfg, ps)  # the canonical sharding of the block's tensors
    full = {f"language_model.encoder.{k}": v for k, v in single.state_dict().items()}
    load_full_state_dict(model, full, strict=False)
    block.load_state_dict(model.language_model.encoder.state_dict())
    with torch.no_grad():
        return {
            "full": gather_positions(block(x), INDEX),
            "pruned": block(x, ForwardContext(query_index=INDEX)),
        }


def test_tensor_parallel_block_at_positions_equals_full() -> None:
    cfg = tiny_config(**FAMILIES["llama"])
    x = torch.randn(3, 16, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    for r in run_distributed(_tp_block, 2, cfg, x):
        torch.testing.assert_close(r["pruned"], r["full"], **TOL)
