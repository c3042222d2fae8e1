"""Layout-independent initialisation (paper section 3 / Megatron defaults).

Every parameter is drawn as a *full* tensor from a generator seeded by ``(seed, canonical name)``
and then sharded, so any TP/PP/VP layout starts from exactly the same function, and the tied
output embedding on the last stage starts equal to the first stage's word embeddings.

* weights ~ N(0, std) with std = ``init_method_std`` (0.02);
* output projections of each layer (``self_attention.dense``, ``mlp.dense_4h_to_h``) use
  std / sqrt(2 N) (N = number of layers);
* biases 0; LayerNorm weight 1, bias 0.
"""

from __future__ import annotations

import math
import zlib

import torch

from pretrain.config import ModelConfig
from pretrain.models.base import ShardedModule
from pretrain.models.sharding import is_vocab_tensor, local_rows, row_layout, shard_tensor
from pretrain.tensor_parallel.layers import partition_dim

SCALED_OUTPUT_LAYERS = ("self_attention.dense.weight", "dense_4h_to_h.weight")  # dense MLP and experts


def _is_layernorm(name: str) -> bool:
    return "layernorm" in name or name.endswith(("_norm.weight", "_norm.bias"))


def full_init_tensor(
    name: str, shape: tuple[int, ...], *, seed: int, std: float, num_layers: int
) -> torch.Tensor:
    """The full fp32 initial value of the tensor with canonical ``name`` and full ``shape``."""
    if name.endswith(".bias"):
        return torch.zeros(shape)
    if _is_layernorm(name):
        return torch.ones(shape)
    if name.endswith(SCALED_OUTPUT_LAYERS):
        std = std / math.sqrt(2.0 * num_layers)
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return torch.empty(shape).normal_(0.0, std, generator=gen)


def full_shape(name: str, param: torch.Tensor, *, tp: int, cfg: ModelConfig) -> tuple[int, ...]:
    """Shape of the canonical full tensor behind a local shard (vocab tensors unpadded)."""
    shape = list(param.shape)
    dim = partition_dim(param)
    if dim is not None:
        shape[dim] *= tp
    lay = row_layout(name, cfg)
    if dim == 0 and lay is not None and lay.groups is not None:  # QKV: replicated K/V when tp > groups
        shape[0] = (cfg.num_attention_heads + 2 * lay.groups) * cfg.head_dim
        assert local_rows(lay, shape[0], tp) == param.shape[0], name
    if is_vocab_tensor(name):
        shape[0] = cfg.vocab_size
    return tuple(shape)


@torch.no_grad()
def init_model_parameters(model: ShardedModule, *, seed: int) -> None:
    """Initialise every parameter of ``model`` (a GPT/BERT stage) from full seeded tensors."""
    cfg, ps, padded = model.cfg, model.ps, model.padded_vocab
    for name, param in model.named_parameters():
        key = model.canonical_name(name)
        shape = full_shape(key, param, tp=ps.tp_size, cfg=cfg)
        full = full_init_tensor(key, shape, seed=seed, std=cfg.init_method_std, num_layers=cfg.num_layers)
        pad = padded if is_vocab_tensor(name) else None
        lay = row_layout(key, cfg)
        param.copy_(
            shard_tensor(
                full, dim=partition_dim(param), tp_rank=ps.tp_rank, tp=ps.tp_size, pad_rows_to=pad, layout=lay
            )
        )
