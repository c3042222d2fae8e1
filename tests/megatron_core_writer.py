"""Write a legacy-format checkpoint with megatron-core itself (test-only; PyPI ``megatron-core``).

``python tests/megatron_core_writer.py OUT VOCAB_JSON MERGES_TXT VOCAB_SIZE``: megatron-core's
``GPTModel`` (local spec, tp=1) built from the full ``args`` Namespace Megatron-LM core_v0.16.1
builds (:func:`tests.megatron_core_peer.megatron_args`, with its real value types: torch dtypes,
the ``AttnBackend`` enum and ``exit_signal=signal.SIGTERM``), naming a GPT-2 BPE tokenizer
(``tokenizer_type``, ``vocab_file``, ``merge_file``); saved as Megatron-LM saves the legacy
format (``args``, ``checkpoint_version``, ``iteration``, ``model`` = its ``state_dict()``), plus the
logits of a probe batch in ``OUT/logits.pt``. Nothing here is mlm-toolkit code.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.ports import free_port


def main(out: str, vocab_file: str, merge_file: str, vocab_size: int) -> None:
    from tests import megatron_core_peer as peer

    peer.init_peer(0, 1, free_port())  # one gloo rank, CPU shims
    args = peer.megatron_args("gpt2", 1)
    args.vocab_size = vocab_size
    divisible = args.make_vocab_size_divisible_by
    args.padded_vocab_size = -(-vocab_size // divisible) * divisible
    args.tokenizer_type, args.vocab_file, args.merge_file = "GPT2BPETokenizer", vocab_file, merge_file
    args.exit_signal = signal.SIGTERM  # as Megatron-LM core_v0.16 stores it
    torch.manual_seed(1234)
    model = peer.build_model(args)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    tokens = torch.randint(0, vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    b, s = tokens.shape
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
    with torch.no_grad():
        logits = model(tokens, pos, mask).float()[..., :vocab_size]
    root = Path(out)
    rank_dir = root / "iter_0000007" / "mp_rank_00"
    rank_dir.mkdir(parents=True)
    state = {"args": args, "checkpoint_version": 3.0, "iteration": 7, "model": model.state_dict()}
    torch.save(state, rank_dir / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text("7")
    torch.save({"tokens": tokens, "logits": logits}, root / "logits.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
