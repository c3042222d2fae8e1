"""A real peer: megatron-core (PyPI) builds, saves, loads and runs GPT models on CPU with gloo.

Run as ``python -m tests.megatron_core_peer save|load ...`` (the tests do, in a subprocess, with
``--tp`` processes). Nothing here is mlm-toolkit code: the model is megatron-core's ``GPTModel``
(local spec), configured from a Megatron-LM ``args`` Namespace the way Megatron-LM's
``core_transformer_config_from_args`` does, and the files are written by megatron-core's own
``dist_checkpointing.save`` (``torch_dist``) and as Megatron-LM's legacy per-rank
``model_optim_rng.pt`` (``args``, ``checkpoint_version``, ``iteration``, ``model``).

* ``save``: build a model from a case's args (``tests/megatron_lm_args.json``: the ``vars(args)``
  Megatron-LM core_v0.16.1 produced, with the case's model fields), save ``torch_dist`` under
  ``OUT/dist``, legacy ``torch`` under ``OUT/legacy`` (megatron-core names) and ``OUT/legacy_te``
  (the TransformerEngine spec's names: norms folded into ``linear_qkv.layer_norm_weight`` /
  ``linear_fc1.layer_norm_weight``), and the logits of the probe batch in ``OUT/logits.pt``.
* ``save-cases OUT CASE...``: ``save`` of several cases at tp 1 in one process, under ``OUT/CASE``.
* ``load``: build the model from the ``args`` in a ``torch_dist`` checkpoint's ``common.pt``, load
  it with ``dist_checkpointing.load`` and write the probe logits to ``OUT/logits.pt``.

CPU shims (megatron-core assumes CUDA in a few places): ``torch.cuda.current_device`` is ``"cpu"``,
``torch.cuda.synchronize`` does nothing, the CUDA RNG tracker's ``fork`` is a no-op (dropout 0).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.ports import free_port

ARGS_JSON = Path(__file__).with_name("megatron_lm_args.json")
PROBE = torch.tensor([[1, 5, 9, 33, 70, 2, 64, 99, 17, 3], [4, 8, 15, 16, 23, 42, 0, 98, 50, 7]])

LLAMA = dict(
    num_layers=2, hidden_size=64, num_attention_heads=8, group_query_attention=True, num_query_groups=2,
    ffn_hidden_size=96, normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
    untie_embeddings_and_output_weights=True, add_bias_linear=False, add_qkv_bias=False, qk_layernorm=False,
    layernorm_epsilon=1e-5, rotary_base=10000, max_position_embeddings=32, seq_length=32, vocab_size=100,
)  # fmt: skip
GPT2 = dict(
    LLAMA, group_query_attention=False, num_query_groups=1, ffn_hidden_size=256, normalization="LayerNorm",
    swiglu=False, position_embedding_type="learned_absolute", untie_embeddings_and_output_weights=False,
    add_bias_linear=True, add_qkv_bias=True, bias_gelu_fusion=False,
)  # fmt: skip
CASES: dict[str, dict[str, Any]] = {
    "llama": LLAMA,
    "llama_qknorm": dict(LLAMA, qk_layernorm=True, rotary_base=500000, kv_channels=16, num_query_groups=4),
    "gpt2": GPT2,
    "gpt2_openai_gelu": dict(GPT2, openai_gelu=True),  # megatron-core ignores it: exact F.gelu
    "gpt2_squared_relu": dict(GPT2, squared_relu=True),
    # options GPT2LMHeadModel lacks (to-hf refuses them) or holds in another form (untied, no biases)
    "gpt2_qknorm": dict(GPT2, qk_layernorm=True),
    "gpt2_untied": dict(GPT2, untie_embeddings_and_output_weights=True),
    "gpt2_kv_channels": dict(GPT2, kv_channels=16),
    "gpt2_swiglu": dict(GPT2, swiglu=True, ffn_hidden_size=96),
    "gpt2_gqa": dict(GPT2, group_query_attention=True, num_query_groups=2),
    "gpt2_no_bias": dict(GPT2, add_bias_linear=False, add_qkv_bias=False),
    # no vocabulary padding at tp <= 2: megatron-core trains padded rows (its softmax spans them),
    # which no converter carries, so resumed training is comparable bit for bit only without them
    "llama_v256": dict(LLAMA, vocab_size=256),
    "gpt2_v256": dict(GPT2, vocab_size=256),
}


def _cpu_shims() -> None:
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]


def megatron_args(case: str, tp: int) -> argparse.Namespace:
    """Megatron-LM's args Namespace (core_v0.16.1 defaults) with the case's model and layout."""
    from megatron.core.transformer.enums import AttnBackend

    raw = json.loads(ARGS_JSON.read_text())["args"]
    ns = argparse.Namespace()
    for key, value in raw.items():
        if isinstance(value, dict) and "__dtype__" in value:
            value = getattr(torch, value["__dtype__"])
        elif isinstance(value, dict) and "__enum__" in value:
            value = AttnBackend[value["name"]]
        setattr(ns, key, value)
    for key, value in CASES[case].items():
        setattr(ns, key, value)
    divisible = ns.make_vocab_size_divisible_by * tp
    ns.padded_vocab_size = -(-ns.vocab_size // divisible) * divisible
    ns.tensor_model_parallel_size, ns.world_size = tp, tp
    ns.hidden_dropout = ns.attention_dropout = 0.0
    if getattr(ns, "kv_channels", None) is None:
        ns.kv_channels = ns.hidden_size // ns.num_attention_heads
    return ns


def transformer_config(args: Any, *, pp: int = 1) -> Any:
    """``TransformerConfig`` from args, as Megatron-LM's ``core_transformer_config_from_args``
    (``pp`` pipeline stages)."""
    import torch.nn.functional as F
    from megatron.core.activations import squared_relu
    from megatron.core.transformer.transformer_config import TransformerConfig

    get = args.get if isinstance(args, dict) else lambda k, d=None: getattr(args, k, d)
    names = vars(args) if not isinstance(args, dict) else args
    kw = {f.name: names[f.name] for f in dataclasses.fields(TransformerConfig) if f.name in names}
    kw.update(
        persist_layer_norm=False, masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=get("tensor_model_parallel_size"), pipeline_model_parallel_size=pp,
        sequence_parallel=False, params_dtype=torch.float32, fp16=False, bf16=False,
        num_moe_experts=None, pipeline_dtype=torch.float32,
    )  # fmt: skip
    kw["layernorm_zero_centered_gamma"] = bool(get("apply_layernorm_1p", False))
    kw["num_query_groups"] = get("num_query_groups") if get("group_query_attention") else None
    kw["bias_activation_fusion"] = bool(get("bias_gelu_fusion", False)) and not get("swiglu")
    if get("swiglu"):
        kw.update(activation_func=F.silu, gated_linear_unit=True, bias_activation_fusion=False)
    elif get("squared_relu"):
        kw["activation_func"] = squared_relu
    kw = {k: v for k, v in kw.items() if k in {f.name for f in dataclasses.fields(TransformerConfig)}}
    return TransformerConfig(**kw)


def build_model(args: Any, *, pp: int = 1, pre_process: bool = True, post_process: bool = True) -> Any:
    """megatron-core's ``GPTModel`` (local spec) from args; one stage of ``pp`` when given."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    get = args.get if isinstance(args, dict) else lambda k, d=None: getattr(args, k, d)
    config = transformer_config(args, pp=pp)
    spec = get_gpt_layer_local_spec(
        normalization=get("normalization"), qk_layernorm=bool(get("qk_layernorm"))
    )
    return GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=get("padded_vocab_size"),
        max_sequence_length=get("max_position_embeddings"),
        position_embedding_type=get("position_embedding_type"),
        share_embeddings_and_output_weights=not get("untie_embeddings_and_output_weights"),
        rotary_percent=get("rotary_percent", 1.0), rotary_base=get("rotary_base", 10000),
        pre_process=pre_process, post_process=post_process,
    ).eval()  # fmt: skip


def probe_logits(model: Any, vocab: int) -> torch.Tensor:
    """Full-vocabulary logits ``[b, s, vocab]`` of :data:`PROBE` (gathered over TP)."""
    from megatron.core import parallel_state as ps

    b, s = PROBE.shape
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
    with torch.no_grad():
        local = model(PROBE, pos, mask).float()
    group = ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim=-1)[..., :vocab]


_TE_RENAMES = [
    (".input_layernorm.", ".self_attention.linear_qkv.layer_norm_"),
    (".pre_mlp_layernorm.", ".mlp.linear_fc1.layer_norm_"),
]


def _te_names(state: dict[str, Any]) -> dict[str, Any]:
    """The TransformerEngine spec's names for a local-spec state dict (norms folded into linears)."""
    out = {}
    for key, value in state.items():
        for old, new in _TE_RENAMES:
            if old in key:
                key = key.replace(old, new)  # ...layer_norm_weight / layer_norm_bias
        out[key] = value
    return out


def _save_legacy(root: Path, args: Any, model: Any, rank: int, *, te: bool) -> None:
    state = {k: v for k, v in model.state_dict().items() if "_extra_state" not in k or te}
    state = _te_names(state) if te else state
    d = root / "iter_0000001" / f"mp_rank_{rank:02d}"
    d.mkdir(parents=True, exist_ok=True)
    torch.save(
        {"args": args, "checkpoint_version": 3.0, "iteration": 1, "model": state}, d / "model_optim_rng.pt"
    )
    (root / "latest_checkpointed_iteration.txt").write_text("1")


def save_dist(root: Path, state: dict[str, Any], iteration: int) -> None:
    """``dist_checkpointing.save`` of ``state`` as Megatron-LM lays it out: ``ROOT/iter_N`` and the
    tracker file (written by rank 0 before every rank saves)."""
    from megatron.core import dist_checkpointing

    it_dir = root / f"iter_{iteration:07d}"
    if dist.get_rank() == 0:
        it_dir.mkdir(parents=True, exist_ok=True)
        (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    dist.barrier()
    dist_checkpointing.save({**state, "iteration": iteration}, str(it_dir))


def _save(out: Path, case: str, rank: int, tp: int) -> None:
    args = megatron_args(case, tp)
    torch.manual_seed(1234)
    model = build_model(args)
    with torch.no_grad():  # non-trivial norms (they are ones at init)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    logits = probe_logits(model, args.vocab_size)
    save_dist(out / "dist", {"args": args, "checkpoint_version": 3.0, "model": model.sharded_state_dict()}, 1)
    _save_legacy(out / "legacy", args, model, rank, te=False)
    _save_legacy(out / "legacy_te", args, model, rank, te=True)
    if rank == 0:
        torch.save(logits, out / "logits.pt")


def load_dist_model(ckpt: Path, tp: int, build: Any) -> tuple[Any, Any]:
    """``(model, args)``: ``build(args)`` from the ``args`` in ``CKPT/common.pt`` at ``tp``, its
    weights loaded by ``dist_checkpointing.load``; every non-``_extra_state`` key must load."""
    from megatron.core import dist_checkpointing

    common = torch.load(ckpt / "common.pt", weights_only=False)
    args = copy.copy(common["args"])
    args.tensor_model_parallel_size = tp
    model = build(args)
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(ckpt))
    missing, unexpected = model.load_state_dict(loaded["model"], strict=False)
    assert not [k for k in missing if "_extra_state" not in k], missing
    assert not unexpected, unexpected
    return model, args


def _load(ckpt: Path, out: Path, rank: int, tp: int) -> None:
    model, args = load_dist_model(ckpt, tp, build_model)
    logits = probe_logits(model, args.vocab_size)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        torch.save(logits, out / "logits.pt")


def init_peer(rank: int, world: int, port: int, *, pp: int = 1) -> None:
    """One gloo rank of a megatron-core peer: CPU shims, process group, model-parallel state
    (tp = ``world // pp``, ``pp`` stages), and the CUDA RNG tracker's ``fork`` as a no-op (dropout is 0)."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    warnings.filterwarnings("ignore")
    _cpu_shims()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ps.initialize_model_parallel(tensor_model_parallel_size=world // pp, pipeline_model_parallel_size=pp)
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()  # type: ignore[method-assign]


def finish_peer() -> None:
    dist.barrier()
    dist.destroy_process_group()


def _worker(rank: int, tp: int, port: int, cmd: str, paths: list[str], case: str) -> None:
    init_peer(rank, tp, port)
    if cmd == "save":
        _save(Path(paths[0]), case, rank, tp)
    else:
        _load(Path(paths[0]), Path(paths[1]), rank, tp)
    finish_peer()


def spawn_ranks(worker: Callable[..., None], args: tuple[Any, ...], nprocs: int) -> None:
    """``worker(rank, *args)`` on ``nprocs`` processes forked from this one once megatron-core is
    imported here (spawned ranks would each import it again: about 5 s of CPU per rank). Forking
    is safe at this point: nothing has run an op, so no intra-op thread pool exists to be lost."""
    import megatron.core.models.gpt  # noqa: F401 -- imported once, inherited by every rank
    import torch.multiprocessing as mp

    mp.start_processes(worker, args=args, nprocs=nprocs, start_method="fork")


def save_load_main(worker: Any, argv: list[str] | None, cases: list[str] | None = None) -> None:
    """The ``save OUT`` / ``load CKPT_ITER_DIR OUT`` command line of a peer: spawn ``--tp``
    ranks of ``worker(rank, tp, port, cmd, paths[, case])``."""
    p = argparse.ArgumentParser()
    p.add_argument("cmd", choices=("save", "load"))
    p.add_argument("paths", nargs="+", help="save: OUT; load: CKPT_ITER_DIR OUT")
    if cases:
        p.add_argument("--case", default=cases[0], choices=sorted(cases))
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--port", type=int, default=None, help="rendezvous port (default: a free one)")
    a = p.parse_args(argv)
    extra = (a.case,) if cases else ()
    spawn_ranks(worker, (a.tp, a.port or free_port(), a.cmd, a.paths, *extra), a.tp)


def save_cases(out: Path, cases: list[str]) -> None:
    """Save each case (tp 1) under ``OUT/CASE`` in this one process (one megatron-core import)."""
    init_peer(0, 1, free_port())
    for case in cases:
        _save(out / case, case, 0, 1)
    finish_peer()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["save-cases"]:  # save-cases OUT CASE [CASE ...]
        save_cases(Path(argv[1]), argv[2:])
        return
    save_load_main(_worker, argv, cases=["llama", *sorted(set(CASES) - {"llama"})])


if __name__ == "__main__":
    sys.exit(main())
