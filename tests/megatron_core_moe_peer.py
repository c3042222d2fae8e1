"""A real peer for mixture-of-experts checkpoints: megatron-core's ``GPTModel`` with MoE layers
(local spec: ``SequentialMLP`` experts, the legacy ``GroupedMLP`` with ``--moe-grouped-gemm
--moe-use-legacy-grouped-gemm``) on CPU with gloo, at TP x EP ranks (test-only; nothing here is
mlm-toolkit code).

``python -m tests.megatron_core_moe_peer save OUT --case C --tp T --ep E``: build the model from
Megatron-LM args (:func:`moe_args`), save ``torch_dist`` (``OUT/dist``, megatron-core's own
``dist_checkpointing.save``; ``OUT/dist_singleton`` with ``singleton_local_shards``: one key per
expert), the legacy per-rank files as Megatron-LM names them
(``OUT/legacy/iter_0000001/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt``, its ``get_checkpoint_name``:
the EP rank is appended as ``_EEE`` when EP > 1) and the probe logits (``OUT/logits.pt``).
``load CKPT_ITER_DIR OUT --case C --tp T --ep E [--etp X]``: load a ``torch_dist`` checkpoint with
``dist_checkpointing.load`` and write the probe logits. ``load-legacy ROOT OUT ...``: load each
rank's legacy file with a strict ``load_state_dict``. ``--etp`` (default TP) runs on
``lcm(TP, ETP x EP)`` ranks, megatron-core's expert groups.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests import megatron_core_peer as peer
from tests.ports import free_port

MOE = dict(
    peer.LLAMA, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_router_pre_softmax=False,
    moe_router_score_function="softmax", moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
    moe_token_dispatcher_type="allgather", moe_layer_freq=1,
)  # fmt: skip
CASES: dict[str, dict[str, Any]] = {
    "moe": MOE,
    # Qwen2-MoE-like: pre-softmax (no renormalisation), a sigmoid-gated shared expert, dense layer 1
    "moe_shared": dict(
        MOE,
        moe_router_pre_softmax=True,
        moe_shared_expert_intermediate_size=48,
        moe_shared_expert_gate=True,
        moe_layer_freq=[1, 0],
    ),  # fmt: skip
    "moe_grouped": dict(MOE, moe_grouped_gemm=True, moe_use_legacy_grouped_gemm=True),
}


def world_of(tp: int, ep: int, etp: int | None) -> int:
    """The smallest world holding TP ranks and ETP x EP expert ranks."""
    import math

    return math.lcm(tp, (etp or tp) * ep)


def moe_args(case: str, tp: int, ep: int, etp: int | None = None) -> argparse.Namespace:
    """Megatron-LM's args (core_v0.16.1 defaults) of an MoE case at ``tp`` x ``ep`` (x ``etp``)."""
    ns = peer.megatron_args("llama", tp)
    for key, value in CASES[case].items():
        setattr(ns, key, value)
    ns.expert_model_parallel_size, ns.expert_tensor_parallel_size = ep, etp or tp
    ns.world_size = world_of(tp, ep, etp)
    return ns


def build_moe_model(args: Any) -> Any:
    """megatron-core's ``GPTModel`` with MoE layers (local spec) from args."""
    import dataclasses

    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    get = args.get if isinstance(args, dict) else lambda k, d=None: getattr(args, k, d)
    fields = (
        "moe_router_topk", "moe_ffn_hidden_size", "moe_router_pre_softmax", "moe_router_score_function",
        "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_token_dispatcher_type", "moe_layer_freq",
        "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_grouped_gemm",
        "moe_use_legacy_grouped_gemm", "moe_router_topk_scaling_factor",
    )  # fmt: skip
    names = dict(vars(args) if not isinstance(args, dict) else args)
    dense = {k: v for k, v in names.items() if k not in fields and not k.startswith("expert_")}
    moe = {k: names[k] for k in fields if names.get(k) is not None}
    config = dataclasses.replace(
        peer.transformer_config(dense), num_moe_experts=get("num_experts"), add_bias_linear=False,
        expert_model_parallel_size=get("expert_model_parallel_size", 1),
        expert_tensor_parallel_size=get("expert_tensor_parallel_size") or get("tensor_model_parallel_size"),
        **moe,
    )  # fmt: skip
    spec = get_gpt_decoder_block_spec(
        config, use_transformer_engine=False, normalization=get("normalization")
    )
    model = GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=get("padded_vocab_size"),
        max_sequence_length=get("max_position_embeddings"),
        position_embedding_type=get("position_embedding_type"),
        share_embeddings_and_output_weights=not get("untie_embeddings_and_output_weights"),
        rotary_percent=get("rotary_percent", 1.0), rotary_base=get("rotary_base", 10000),
    ).eval()  # fmt: skip
    for module in model.modules():  # GroupedMLP's forward asserts bf16; its fp32 weights compute the same
        if type(module).__name__ == "GroupedMLP":
            module.config = dataclasses.replace(module.config, bf16=True, params_dtype=torch.bfloat16)
    return model


def _grouped_gemm_on_cpu() -> None:
    """GroupedMLP calls the ``grouped_gemm`` CUDA package's ``gmm(a, b, batch_sizes, trans_b)``:
    rows of ``a`` in consecutive groups of ``batch_sizes``, group ``i`` times ``b[i]``. On CPU the
    same product as a loop (the weights' layout, which these tests are about, stays megatron-core's)."""
    from megatron.core.transformer.moe import grouped_gemm_util as gg

    class _Ops:
        @staticmethod
        def gmm(
            a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor, trans_b: bool = False
        ) -> torch.Tensor:
            parts = a.split(batch_sizes.tolist())
            return torch.cat([p @ (b[i].t() if trans_b else b[i]) for i, p in enumerate(parts)])

    gg.grouped_gemm_is_available = lambda: True
    gg.ops = _Ops


def _init(rank: int, tp: int, ep: int, port: int, etp: int | None = None) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    warnings.filterwarnings("ignore")
    peer._cpu_shims()
    from megatron.core.transformer.moe import moe_utils

    moe_utils.te_general_gemm = None  # its import failed without TransformerEngine; the plain GEMM runs
    _grouped_gemm_on_cpu()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_of(tp, ep, etp))
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp
    )
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()  # type: ignore[method-assign]


def legacy_dir_name(tp_rank: int, ep_rank: int, ep: int) -> str:
    """Megatron-LM's ``get_checkpoint_name`` at PP 1: ``mp_rank_TT``, then ``_EEE`` when EP > 1."""
    return f"mp_rank_{tp_rank:02d}" + (f"_{ep_rank:03d}" if ep > 1 else "")


def _spread_router(model: Any) -> None:
    """Router weights with a wide spread and non-trivial norms (top-k differs between tokens)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith("router.weight"):
                p.copy_(torch.randn_like(p))


def _save(out: Path, case: str, rank: int, tp: int, ep: int) -> None:
    from megatron.core import parallel_state as ps

    args = moe_args(case, tp, ep)
    torch.manual_seed(1234)
    model = build_moe_model(args)
    _spread_router(model)
    # the same seed gives every rank the same dense weights; the experts of each EP (and expert-TP)
    # rank are drawn from a seed of their own, so that no two experts are equal
    g = torch.Generator().manual_seed(100 + 10 * ps.get_expert_model_parallel_rank()
                                      + ps.get_expert_tensor_parallel_rank())  # fmt: skip
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if ".experts." in pname:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    logits = peer.probe_logits(model, args.vocab_size)
    peer.save_dist(
        out / "dist", {"args": args, "checkpoint_version": 3.0, "model": model.sharded_state_dict()}, 1
    )
    singleton = model.sharded_state_dict(metadata={"singleton_local_shards": True})  # one key per expert
    peer.save_dist(out / "dist_singleton", {"args": args, "checkpoint_version": 3.0, "model": singleton}, 1)
    state = {k: v for k, v in model.state_dict().items() if "_extra_state" not in k}
    name = legacy_dir_name(ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank(), ep)
    d = out / "legacy" / "iter_0000001" / name
    d.mkdir(parents=True, exist_ok=True)
    torch.save(
        {"args": args, "checkpoint_version": 3.0, "iteration": 1, "model": state}, d / "model_optim_rng.pt"
    )
    (out / "legacy" / "latest_checkpointed_iteration.txt").write_text("1")
    if rank == 0:
        torch.save(logits, out / "logits.pt")


def _load(ckpt: Path, out: Path, rank: int, tp: int, ep: int, legacy: bool, etp: int | None = None) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    if legacy:
        it_dir = ckpt / "iter_0000001" if (ckpt / "iter_0000001").is_dir() else ckpt / "release"
        name = legacy_dir_name(ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank(), ep)
        state = torch.load(it_dir / name / "model_optim_rng.pt", weights_only=False)
        args = state["args"]
        args.tensor_model_parallel_size, args.expert_model_parallel_size = tp, ep
        args.expert_tensor_parallel_size = etp or tp
        model = build_moe_model(args)
        missing, unexpected = model.load_state_dict(state["model"], strict=False)
    else:
        args = torch.load(ckpt / "common.pt", weights_only=False)["args"]
        args.tensor_model_parallel_size, args.expert_model_parallel_size = tp, ep
        args.expert_tensor_parallel_size = etp or tp
        model = build_moe_model(args)
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(ckpt))
        missing, unexpected = model.load_state_dict(loaded["model"], strict=False)
    assert not [k for k in missing if "_extra_state" not in k], missing
    assert not unexpected, unexpected
    logits = peer.probe_logits(model, args.vocab_size)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        torch.save(logits, out / "logits.pt")


def _worker(
    rank: int, tp: int, ep: int, port: int, cmd: str, paths: list[str], case: str, etp: int | None = None
) -> None:
    _init(rank, tp, ep, port, etp)
    if cmd == "save":
        _save(Path(paths[0]), case, rank, tp, ep)
    else:
        _load(Path(paths[0]), Path(paths[1]), rank, tp, ep, legacy=cmd == "load-legacy", etp=etp)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("cmd", choices=("save", "load", "load-legacy"))
    p.add_argument("paths", nargs="+")
    p.add_argument("--case", default="moe", choices=sorted(CASES))
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--etp", type=int, default=None)
    a = p.parse_args(argv)
    if a.etp is not None and a.cmd == "save":
        p.error("--etp: load only")
    world = world_of(a.tp, a.ep, a.etp)
    if world == 1:
        _worker(0, 1, 1, free_port(), a.cmd, a.paths, a.case)
        return
    peer.spawn_ranks(_worker, (a.tp, a.ep, free_port(), a.cmd, a.paths, a.case, a.etp), world)


if __name__ == "__main__":
    sys.exit(main())
