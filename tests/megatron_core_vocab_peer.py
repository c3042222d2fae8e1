"""megatron-core saves a GPT-2-BPE run at TP >= 2 (and PP >= 1) as Megatron-LM does (test-only).

``python -m tests.megatron_core_vocab_peer OUT --case gpt2|llama --tp T --pp P VOCAB_JSON MERGES``
spawns ``T * P`` gloo ranks. The ``args`` are what Megatron-LM core_v0.16.1 keeps for a run
trained with ``--tokenizer-type GPT2BPETokenizer --vocab-file --merge-file`` and no
``--vocab-size``: ``vocab_size`` is None and ``padded_vocab_size`` is the tokenizer's size padded
to a multiple of ``make_vocab_size_divisible_by * T`` (megatron's ``_vocab_size_with_padding``).
megatron-core's ``GPTModel`` (one pipeline stage per rank) is saved with its own
``dist_checkpointing.save`` under ``OUT/dist`` and as legacy per-rank files under ``OUT/legacy``
(``mp_rank_TT`` or ``mp_rank_TT_PPP``). At ``P == 1`` the probe logits (true vocabulary) go to
``OUT/logits.pt``; at ``P > 1`` the tests take them from megatron-core's own load of ``OUT/dist``
at ``P == 1`` (``python -m tests.megatron_core_peer load``). Nothing here is mlm-toolkit code.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from tests import megatron_core_peer as peer
from tests.ports import free_port


def _worker(rank: int, world: int, port: int, a: argparse.Namespace) -> None:
    from megatron.core import parallel_state as ps

    peer.init_peer(rank, world, port, pp=a.pp)
    torch.Tensor.cuda = lambda self, *x, **k: self  # type: ignore[method-assign]  # tied-head sync
    args = peer.megatron_args(a.case, a.tp)
    vocab = len(json.loads(Path(a.vocab_json).read_text()))
    multiple = args.make_vocab_size_divisible_by * a.tp
    args.vocab_size, args.padded_vocab_size = None, -(-vocab // multiple) * multiple
    args.tokenizer_type, args.vocab_file, args.merge_file = "GPT2BPETokenizer", a.vocab_json, a.merges
    args.pipeline_model_parallel_size, args.world_size = a.pp, world
    torch.manual_seed(1234)
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    model = peer.build_model(args, pp=a.pp, pre_process=first, post_process=last)
    with torch.no_grad():  # non-trivial norms (they are ones at init)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    out = Path(a.out)
    state = {"args": args, "checkpoint_version": 3.0, "model": model.sharded_state_dict()}
    peer.save_dist(out / "dist", state, 1)
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    name = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if a.pp > 1 else "")
    d = out / "legacy" / "iter_0000001" / name
    d.mkdir(parents=True, exist_ok=True)
    legacy = {k: v for k, v in model.state_dict().items() if "_extra_state" not in k}
    torch.save(
        {"args": args, "checkpoint_version": 3.0, "iteration": 1, "model": legacy}, d / "model_optim_rng.pt"
    )
    if rank == 0:
        (out / "legacy" / "latest_checkpointed_iteration.txt").write_text("1")
    if a.pp == 1:
        logits = peer.probe_logits(model, vocab)
        if rank == 0:
            torch.save(logits, out / "logits.pt")
    peer.finish_peer()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("vocab_json")
    p.add_argument("merges")
    p.add_argument("--case", default="gpt2", choices=sorted(peer.CASES))
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=1)
    a = p.parse_args(argv)
    world = a.tp * a.pp
    peer.spawn_ranks(_worker, (world, free_port(), a), world)


if __name__ == "__main__":
    sys.exit(main())
