"""A real peer for sequence parallelism: megatron-core's ``GPTModel`` trained one step at TP with
``sequence_parallel=True`` on CPU/gloo (its all-gather / reduce-scatter GEMMs, its scattered
embeddings, its ``finalize_model_grads`` sum of ``sequence_parallel`` gradients).

``python -m tests.megatron_core_sp_peer OUT --case CASE --tp N``: build the case as
:mod:`tests.megatron_core_peer` does (same args, seed and perturbed norms) but with sequence
parallelism on, save it as ``torch_dist`` under ``OUT/dist``, run forward and backward in training
mode on :data:`~tests.megatron_core_peer.PROBE` (next-token labels, mean loss), sum the
``sequence_parallel`` gradients over TP with megatron-core's own
``_allreduce_non_tensor_model_parallel_grads``, and write ``OUT/step.pt``: the loss and the
gradients of every parameter megatron-core tags ``sequence_parallel`` (norms, row-parallel
biases), by megatron-core name.

CPU shim: the local spec's ``WrappedTorchNorm`` (plain ``torch.nn`` norms) refuses sequence
parallelism only because it does not tag its parameters; it is built here with the flag off and
its parameters tagged ``sequence_parallel`` afterwards, which is what megatron-core's own fused
norms (Apex / TransformerEngine, GPU only) do.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
from pathlib import Path
from typing import Any

import torch

from tests.megatron_core_peer import (
    CASES,
    PROBE,
    finish_peer,
    init_peer,
    megatron_args,
    save_dist,
    spawn_ranks,
    transformer_config,
)
from tests.ports import free_port


def _tag_norms() -> None:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    real = WrappedTorchNorm.__new__

    def new(cls: type, config: Any, hidden_size: int, *a: Any, **kw: Any) -> Any:
        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = real(cls, plain, hidden_size, *a, **kw)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm

    WrappedTorchNorm.__new__ = staticmethod(new)  # type: ignore[assignment]


def _build(args: Any) -> Any:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = dataclasses.replace(transformer_config(args), sequence_parallel=True)
    spec = get_gpt_layer_local_spec(normalization=args.normalization, qk_layernorm=bool(args.qk_layernorm))
    return GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings, position_embedding_type=args.position_embedding_type,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        rotary_percent=getattr(args, "rotary_percent", 1.0), rotary_base=args.rotary_base,
    )  # fmt: skip


def _worker(rank: int, tp: int, port: int, out: str, case: str) -> None:
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import _allreduce_non_tensor_model_parallel_grads

    init_peer(rank, tp, port)
    _tag_norms()
    args = megatron_args(case, tp)
    torch.manual_seed(1234)
    model = _build(args)
    with torch.no_grad():  # non-trivial norms (they are ones at init)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    save_dist(
        Path(out) / "dist", {"args": args, "checkpoint_version": 3.0, "model": model.sharded_state_dict()}, 1
    )
    model.train()
    b, s = PROBE.shape
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
    losses = model(PROBE, pos, mask, labels=PROBE.roll(-1, dims=1))
    loss = losses.float().mean()
    loss.backward()
    model.ddp_config = DistributedDataParallelConfig()
    _allreduce_non_tensor_model_parallel_grads([model], model.config)
    marked = {
        n: p.grad.clone() for n, p in model.named_parameters() if getattr(p, "sequence_parallel", False)
    }
    if rank == 0:
        torch.save({"loss": loss.detach(), "grads": marked}, Path(out) / "step.pt")
    finish_peer()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--case", default="llama", choices=sorted(CASES))
    p.add_argument("--tp", type=int, default=2)
    a = p.parse_args(argv)
    spawn_ranks(_worker, (a.tp, free_port(), a.out, a.case), a.tp)


if __name__ == "__main__":
    sys.exit(main())
