"""Checkpoints laid out as megatron-core 0.19 writes them, by megatron-core 0.16.1 (test-only).

megatron-core 0.17+ needs Python >= 3.12, so this runs the installed 0.16.1 and reproduces what
changed (docs/megatron-core-versions.md):

* the ``args`` are the ``vars(args)`` Megatron-LM core_v0.19.0 builds
  (``tests/megatron_lm_args_v019.json``, the Llama command line of ``tests/megatron_lm_args.json``,
  tp 2), with its value types (torch dtypes, ``AttnBackend``, ``InferenceCudaGraphScope``,
  ``signal.Signals``) and ``padded_vocab_size`` as its tokenizer setup pads 100 tokens at tp 2 (256);
* ``torch_dist``: no ``common.pt``: the common state (``args``, ``checkpoint_version``,
  ``iteration``) is the ``ShardedObject("common_state", global_shape=(1,), global_offset=(0,))``
  in the ``.distcp`` files (0.19 ``dist_checkpointing.save``; 0.16.1 stores a ``ShardedObject``
  the same way: ``torch.save`` of ``[data]`` under ``common_state/shard_0_1``), and
  ``metadata.json`` without the ``common_backend`` fields;
* legacy: ``model_optim_rng.pt`` per TP rank with the same ``args``.

``python -m tests.megatron_core_v019_writer OUT [FIELD=JSON ...]`` (2 gloo ranks): ``OUT/dist``,
``OUT/legacy`` and the probe logits ``OUT/logits.pt``; ``FIELD=JSON`` overrides an ``args`` field.
The model is megatron-core's ``GPTModel`` of the same architecture. Nothing here is mlm-toolkit code.
"""

from __future__ import annotations

import argparse
import enum
import json
import signal
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests import megatron_core_peer as peer
from tests.ports import free_port

ARGS_V019 = Path(__file__).with_name("megatron_lm_args_v019.json")


def _enum(qualified: str, name: str) -> Any:
    """The member ``name`` of the enum ``qualified``; an enum megatron-core 0.16.1 lacks is made
    under its 0.19 module path, so that the pickle names it as 0.19's does."""
    module, cls_name = qualified.rsplit(".", 1)
    if qualified == "signal.Signals":
        return signal.Signals[name]
    mod = __import__(module, fromlist=[cls_name])
    cls = getattr(mod, cls_name, None)
    if cls is None:
        cls = enum.Enum(cls_name, {name: 0}, module=module)  # type: ignore[misc]
        setattr(mod, cls_name, cls)
    return cls[name]


def v019_args(**changes: Any) -> argparse.Namespace:
    """Megatron-LM core_v0.19.0's args Namespace (real value types) with ``changes``."""
    ns = argparse.Namespace()
    for key, value in json.loads(ARGS_V019.read_text())["args"].items():
        if isinstance(value, dict) and "__dtype__" in value:
            value = getattr(torch, value["__dtype__"])
        elif isinstance(value, dict) and "__enum__" in value:
            value = _enum(value["__enum__"], value["name"])
        setattr(ns, key, value)
    ns.padded_vocab_size = 256  # megatron's build_tokenizer: 100 tokens padded to 128 x tp 2
    for key, value in changes.items():
        setattr(ns, key, value)
    return ns


def _worker(rank: int, world: int, port: int, out: Path, changes: dict[str, Any]) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    peer.init_peer(rank, world, port)
    args = v019_args(**changes)
    torch.manual_seed(1234)
    model = peer.build_model(peer.megatron_args("llama", world))  # the fixture's architecture
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    logits = peer.probe_logits(model, 100)
    common = {"args": args, "checkpoint_version": 3.0, "iteration": 1}
    it_dir = out / "dist" / "iter_0000001"
    if rank == 0:
        it_dir.mkdir(parents=True)
        (out / "dist" / "latest_checkpointed_iteration.txt").write_text("1")
    dist.barrier()
    state = {"model": model.sharded_state_dict(),
             "common_state": ShardedObject("common_state", common, (1,), (0,), replica_id=rank)}  # fmt: skip
    dist_checkpointing.save(state, str(it_dir))
    dist.barrier()
    if rank == 0:  # 0.19 writes neither common.pt nor the common_backend fields
        (it_dir / "common.pt").unlink()
        (it_dir / "metadata.json").write_text(
            json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1})
        )
        torch.save(logits, out / "logits.pt")
    d = out / "legacy" / "iter_0000001" / f"mp_rank_{rank:02d}"
    d.mkdir(parents=True, exist_ok=True)
    legacy = {k: v for k, v in model.state_dict().items() if "_extra_state" not in k}
    torch.save({**common, "model": legacy}, d / "model_optim_rng.pt")
    if rank == 0:
        (out / "legacy" / "latest_checkpointed_iteration.txt").write_text("1")
    peer.finish_peer()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("changes", nargs="*", help="FIELD=JSON overrides of the 0.19 args")
    a = p.parse_args(argv)
    changes = {k: json.loads(v) for k, v in (c.split("=", 1) for c in a.changes)}
    peer.spawn_ranks(_worker, (2, free_port(), Path(a.out), changes), 2)


if __name__ == "__main__":
    sys.exit(main())
