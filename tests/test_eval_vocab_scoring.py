"""Vocab-parallel float64 NLL/argmax equals the one-process reference, ties and empty shards included."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mlm_eval.scoring.scorer import nll_and_argmax
from mlm_eval.scoring.vocab import vocab_parallel_nll_and_argmax
from tests.distributed import run_distributed


def _case(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits with many ties (small integers) and targets that hit, tie-lose or miss the argmax."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, 3, (40, 9), generator=g).float() * 0.5
    first_max = logits.argmax(dim=1)
    last_max = 8 - logits.flip(1).argmax(dim=1)  # another maximum when there is a tie
    random = torch.randint(0, 9, (40,), generator=g)
    targets = torch.where(
        torch.arange(40) % 3 == 0, first_max, torch.where(torch.arange(40) % 3 == 1, last_max, random)
    )
    return logits, targets


def _shard(rank: int, world: int, widths: list[int]) -> dict[str, torch.Tensor]:
    logits, targets = _case()
    group = dist.new_group(list(range(world)))
    start = sum(widths[:rank])
    out = vocab_parallel_nll_and_argmax(
        logits[:, start : start + widths[rank]], targets, vocab_start=start, group=group
    )
    return {"nll": out.nll, "hit": out.is_argmax}


@pytest.mark.slow
@pytest.mark.parametrize("widths", [[4, 5], [5, 0, 4]])
def test_vocab_parallel_equals_gathered(widths: list[int]) -> None:
    logits, targets = _case()
    ref = nll_and_argmax(logits, targets, 9)
    assert 0 < int(ref.is_argmax.sum()) < 40  # the case exercises both outcomes
    tie_losers = (logits[torch.arange(40), targets] == logits.max(dim=1).values) & ~ref.is_argmax
    assert tie_losers.any()  # a target that ties the max but is not the first index
    for got in run_distributed(_shard, len(widths), widths):
        assert torch.equal(got["hit"], ref.is_argmax)
        torch.testing.assert_close(got["nll"], ref.nll, rtol=1e-12, atol=1e-12)


def test_single_process_equals_reference() -> None:
    logits, targets = _case(1)
    got = vocab_parallel_nll_and_argmax(logits, targets, vocab_start=0, group=None)
    ref = nll_and_argmax(logits, targets, 9)
    assert torch.equal(got.is_argmax, ref.is_argmax)
    torch.testing.assert_close(got.nll, ref.nll, rtol=1e-12, atol=1e-12)
