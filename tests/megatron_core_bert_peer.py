"""A real peer for BERT: megatron-core's ``BertModel`` (local spec) saves, loads and runs on CPU/gloo.

Run as ``python -m tests.megatron_core_bert_peer save|load ...`` (the tests do, in a subprocess,
with ``--tp`` processes). Nothing here is mlm-toolkit code: the model is megatron-core's
``BertModel`` with ``bert_layer_local_spec``, built as Megatron-LM's ``pretrain_bert.py`` builds it
(``num_tokentypes = 2 if args.bert_binary_head else 0``, ``vocab_size=args.padded_vocab_size``,
embeddings shared with the output layer, the padding mask ``1 = real token`` as ``attention_mask``)
from a Megatron-LM ``args`` Namespace (the GPT peer's core_v0.16.1 defaults with BERT's fields).

* ``save OUT``: build a model, save it with ``dist_checkpointing.save`` under ``OUT/dist`` and
  the probe's outputs in ``OUT/logits.pt``.
* ``load CKPT_ITER_DIR OUT``: build the model from the ``args`` of a ``torch_dist`` checkpoint's
  ``common.pt``, load it with ``dist_checkpointing.load`` and write the probe's outputs.

The probe (:data:`PROBE`, :data:`TOKENTYPES`, :data:`MASK`) pads the second sequence; outputs are
``{"mlm": [b, s, vocab] (gathered over TP), "binary": [b, 2]}``. Padded query positions differ
between implementations (megatron-core masks them as queries too), so callers compare the real
positions (:data:`MASK`). CPU shims: those of :mod:`tests.megatron_core_peer`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

PROBE = torch.tensor([[2, 5, 9, 33, 70, 3, 64, 99, 17, 3], [2, 8, 15, 16, 3, 42, 0, 98, 0, 0]])
TOKENTYPES = torch.tensor([[0, 0, 0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1, 1, 1, 0, 0]])
MASK = torch.tensor([[1] * 10, [1] * 8 + [0] * 2])
VOCAB = 100
BERT = dict(
    num_layers=2, hidden_size=64, num_attention_heads=4, group_query_attention=False, num_query_groups=1,
    ffn_hidden_size=256, normalization="LayerNorm", swiglu=False, position_embedding_type="learned_absolute",
    untie_embeddings_and_output_weights=False, add_bias_linear=True, add_qkv_bias=True, qk_layernorm=False,
    bias_gelu_fusion=False, openai_gelu=False, layernorm_epsilon=1e-5, max_position_embeddings=32,
    seq_length=32, vocab_size=VOCAB, bert_binary_head=True, tokenizer_type="BertWordPieceLowerCase",
)  # fmt: skip


def bert_args(tp: int) -> argparse.Namespace:
    """Megatron-LM's args Namespace (core_v0.16.1 defaults) for the probe BERT at ``tp``."""
    from tests.megatron_core_peer import megatron_args

    ns = megatron_args("gpt2", tp)  # the same vocabulary size, so the same padding
    for key, value in BERT.items():
        setattr(ns, key, value)
    return ns


def build_model(args: Any) -> Any:
    """megatron-core ``BertModel`` as Megatron-LM's ``pretrain_bert.model_provider`` builds it."""
    from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
    from megatron.core.models.bert.bert_model import BertModel

    from tests.megatron_core_peer import transformer_config

    get = args.get if isinstance(args, dict) else lambda k, d=None: getattr(args, k, d)
    binary = bool(get("bert_binary_head"))
    return BertModel(
        config=transformer_config(args), num_tokentypes=2 if binary else 0,
        transformer_layer_spec=bert_layer_local_spec, vocab_size=get("padded_vocab_size"),
        max_sequence_length=get("max_position_embeddings"), share_embeddings_and_output_weights=True,
        add_binary_head=binary, parallel_output=True,
    ).eval()  # fmt: skip


def probe_outputs(model: Any, vocab: int) -> dict[str, torch.Tensor]:
    """MLM logits ``[b, s, vocab]`` (gathered over TP) and binary-head logits ``[b, 2]`` of the probe."""
    from megatron.core import parallel_state as ps

    with torch.no_grad():
        local, binary = model(PROBE, MASK, tokentype_ids=TOKENTYPES)
    group = ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.float().contiguous(), group=group)
    return {"mlm": torch.cat(parts, dim=-1)[..., :vocab], "binary": binary.float()}


def _save(out: Path, rank: int, tp: int) -> None:
    from tests.megatron_core_peer import save_dist

    args = bert_args(tp)
    torch.manual_seed(1234)
    model = build_model(args)
    with torch.no_grad():  # non-trivial norms and biases (ones and zeros at init)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    outputs = probe_outputs(model, args.vocab_size)
    save_dist(out / "dist", {"args": args, "checkpoint_version": 3.0, "model": model.sharded_state_dict()}, 1)
    if rank == 0:
        torch.save(outputs, out / "logits.pt")


def _load(ckpt: Path, out: Path, rank: int, tp: int) -> None:
    from tests.megatron_core_peer import load_dist_model

    model, args = load_dist_model(ckpt, tp, build_model)
    outputs = probe_outputs(model, args.vocab_size)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        torch.save(outputs, out / "logits.pt")


def _worker(rank: int, tp: int, port: int, cmd: str, paths: list[str]) -> None:
    from tests.megatron_core_peer import finish_peer, init_peer

    init_peer(rank, tp, port)
    if cmd == "save":
        _save(Path(paths[0]), rank, tp)
    else:
        _load(Path(paths[0]), Path(paths[1]), rank, tp)
    finish_peer()


def main(argv: list[str] | None = None) -> None:
    from tests.megatron_core_peer import save_load_main

    save_load_main(_worker, argv)


if __name__ == "__main__":
    sys.exit(main())
