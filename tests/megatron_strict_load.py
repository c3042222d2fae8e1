"""Load one of our legacy-format rank files the way Megatron-LM's ``load_checkpoint`` does (test-only).

``python tests/megatron_strict_load.py FILE OUT``: read ``FILE`` with ``torch.load(weights_only=False)``
(as Megatron-LM does), build megatron-core's ``GPTModel`` (local spec) from the file's ``args``
Namespace (:mod:`tests.megatron_core_peer`, mirroring ``core_transformer_config_from_args``), load
``state["model"]`` with ``load_state_dict(strict=True)`` -- every key must match -- and save the
logits of a probe batch to ``OUT`` as ``{"tokens", "logits"}``. Nothing here is mlm-toolkit code.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from tests.ports import free_port


def main(path: str, out: str) -> None:
    from tests import megatron_core_peer as peer

    peer.init_peer(0, 1, free_port())  # one gloo rank, CPU shims
    state = torch.load(path, map_location="cpu", weights_only=False)
    args = state["args"]
    model = peer.build_model(args)
    model.load_state_dict(state["model"], strict=True)
    tokens = torch.tensor([[1, 5, 9, 33, 70, 2, 64, 99, 17, 3], [4, 8, 15, 16, 23, 42, 0, 98, 50, 7]])
    b, s = tokens.shape
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
    with torch.no_grad():
        logits = model(tokens, pos, mask).float()
    torch.save({"tokens": tokens, "logits": logits}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
