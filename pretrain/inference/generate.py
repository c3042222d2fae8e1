"""Batched autoregressive generation on one model stage, under any TP x PP layout.

Prompts of different lengths are left-padded to a common width; every row gets its own
positions (``cumsum(valid) - 1``) and an attention mask that hides its padding, so a row
generates the same tokens whatever other rows share its batch. Each step either feeds only the
new position and reuses the :class:`~pretrain.models.kv_cache.KVCache` (``use_cache``), or
recomputes the whole sequence (the reference the cache is tested against).

Parallelism: tensor-parallel ranks run their heads (each caches its own) and all-gather the
final logits over the TP group; pipeline stages pass the hidden states of the fed positions
``[b, s, h]`` forward with point-to-point sends every step, the last stage chooses the next
tokens, and a broadcast over the pipeline group gives them to every stage. All ranks of a
model-parallel group must call :func:`generate` with the same prompts and configuration.

Expert parallelism: every forward of a mixture-of-experts layer is an all-to-all over the
expert-parallel group, which spans data-parallel replicas (or TP ranks), so replicas generating
different prompts must step together: each step ends with a MAX all-reduce of "still running" over
the data-parallel group, and a replica whose rows have all finished keeps stepping (its outputs
are dropped) until every replica has. Callers give every replica the same number of
:func:`generate` calls (:meth:`mlm_eval.harness.engine.HarnessEngine.generate` pads with rows
marked done).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from pretrain.inference.sampling import SamplingConfig, next_tokens, row_generators
from pretrain.models.forward_context import ForwardContext
from pretrain.models.gpt import GPTModel
from pretrain.models.kv_cache import KVCache
from pretrain.models.language_model import parallel_lm_logits
from pretrain.models.transformer import DTYPES
from pretrain.pipeline.p2p import PipelineComm

StopFn = Callable[[int, list[int]], bool]  # (row, its generated ids so far) -> stop this row now
TokenFn = Callable[[int, int], None]  # (row, new token id), called on every rank


@dataclass(frozen=True, kw_only=True)
class GenerationConfig:
    """What to generate: at most ``max_new_tokens`` per row, stopping at ``eos_id``."""

    max_new_tokens: int = 32
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    use_cache: bool = True
    eos_id: int | None = None  # generating it ends the row (it is not part of the output)
    pad_id: int = 0  # fills the left padding (never attended to)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``[b, w]`` with each prompt right-aligned, and the bool mask of real tokens."""
    width = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    valid = torch.zeros((len(prompts), width), dtype=torch.bool)
    for i, p in enumerate(prompts):
        if p:
            tokens[i, width - len(p) :] = torch.as_tensor(list(p), dtype=torch.long)
            valid[i, width - len(p) :] = True
    return tokens, valid


def attention_mask(valid: torch.Tensor, start: int) -> torch.Tensor:
    """Bool ``[b, 1, w - start, w]``: query ``i >= start`` may see key ``j`` iff ``j <= i`` and ``j`` is real.

    Every query also sees itself, so padding queries (whose outputs are never used) stay finite.
    """
    w = valid.shape[1]
    q = torch.arange(start, w, device=valid.device)[:, None]
    k = torch.arange(w, device=valid.device)[None, :]
    mask = (k <= q)[None] & valid[:, None, :]
    return (mask | (k == q)[None])[:, None]


def last_logits(model: GPTModel, hidden: torch.Tensor) -> torch.Tensor:
    """Float32 logits ``[b, V]`` over the true vocabulary from final hidden states ``[b, h]``.

    Collective: one all-gather over the TP group (padding rows are never multiplied).
    """
    local = parallel_lm_logits(
        hidden,
        model.output_weight(),  # the embedding, or the untied output layer
        ps=model.ps,
        vocab_start=model.vocab_start,
        true_vocab=model.cfg.vocab_size,
    )
    return model.full_logits(local).float()


@torch.inference_mode()
def generate(
    model: GPTModel,
    prompts: Sequence[Sequence[int]],
    cfg: GenerationConfig,
    *,
    stop: StopFn | None = None,
    seeds: Sequence[int] | None = None,
    on_token: TokenFn | None = None,
) -> list[list[int]]:
    """Generated ids per prompt (without the prompt, without a final ``eos_id``).

    ``seeds``: per-row sampling seed offsets (default the row index), so sampled rows do not
    depend on their batch. Raises ``ValueError`` if a prompt plus ``max_new_tokens`` exceeds the
    model's positions (callers cut prompts on the left first).
    """
    if not prompts:
        return []
    ps = model.ps
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    tokens, valid = left_pad(prompts, cfg.pad_id)
    tokens, valid = tokens.to(ps.device), valid.to(ps.device)
    capacity = tokens.shape[1] + cfg.max_new_tokens
    if capacity > model.cfg.max_position_embeddings:
        raise ValueError(
            f"{tokens.shape[1]} prompt + {cfg.max_new_tokens} new tokens exceed the model's "
            f"{model.cfg.max_position_embeddings} positions"
        )
    b = len(prompts)
    cache = KVCache(len(model.language_model.encoder.layers), capacity) if cfg.use_cache else None
    gens = None
    if not cfg.sampling.greedy:
        gens = row_generators(cfg.sampling, list(seeds) if seeds is not None else list(range(b)), ps.device)
    comm = PipelineComm(ps) if ps.pp_size > 1 else None
    out: list[list[int]] = [[] for _ in range(b)]
    done = [False] * b
    for _ in range(cfg.max_new_tokens):
        nxt = _step(model, tokens, valid, cache, comm, cfg.sampling, gens)
        _record(nxt.tolist(), out, done, cfg, stop, on_token)
        tokens = torch.cat([tokens, nxt[:, None]], dim=1)
        valid = torch.cat([valid, torch.ones_like(valid[:, :1])], dim=1)
        if not _any_running(model, done):
            break
    if comm is not None:
        comm.wait_all()
    return out


def _any_running(model: GPTModel, done: list[bool]) -> bool:
    """Whether a row of this replica (or, with expert parallelism, of any replica) still runs.

    Collective with EP > 1: a MAX all-reduce over the data-parallel group, so every rank of every
    replica takes the same decision (a rank that stopped alone would leave its EP peers waiting in
    the next expert all-to-all). Every rank of a replica holds the same ``done``."""
    ps = model.ps
    running = not all(done)
    if ps.ep_size == 1 or ps.dp_group is None or ps.dp_size == 1:
        return running
    flag = torch.tensor([int(running)], dtype=torch.int64, device=ps.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=ps.dp_group)
    return bool(flag.item())


def _step(model: GPTModel, tokens: torch.Tensor, valid: torch.Tensor, cache: KVCache | None,
          comm: PipelineComm | None, sampling: SamplingConfig,
          gens: list[torch.Generator] | None) -> torch.Tensor:  # fmt: skip
    """One decoding step on this stage: the next token of every row ``[b]`` (on every stage).

    Feeds the positions not yet cached (all of them without a cache); a later stage receives the
    previous stage's hidden states and sends its own on. Collectives: p2p between stages, the
    TP all-gather of the last logits, and a broadcast of the tokens over the pipeline group.
    """
    ps = model.ps
    b = tokens.shape[0]
    start = cache.length if cache is not None else 0
    positions = (valid.long().cumsum(dim=1) - 1).clamp(min=0)
    feed = tokens[:, start:]
    hidden = None
    if comm is not None and not ps.is_first_stage:
        hidden = comm.recv((b, feed.shape[1], model.cfg.hidden_size), DTYPES[model.cfg.params_dtype],
                           from_next=False)  # fmt: skip
    ctx = ForwardContext(
        attn_mask=attention_mask(valid, start), position_ids=positions[:, start:], kv_cache=cache
    )
    hidden = model.trunk(feed, hidden_states=hidden, ctx=ctx)
    if comm is not None and not ps.is_last_stage:
        comm.send(hidden, to_next=True)
    nxt = torch.zeros(b, dtype=torch.long, device=ps.device)
    if ps.is_last_stage:
        nxt = next_tokens(last_logits(model, hidden[:, -1]), sampling, gens).to(ps.device)
    if ps.pp_group is not None and ps.pp_size > 1:
        dist.broadcast(nxt, src=ps.pp_ranks[-1], group=ps.pp_group)
    return nxt


def _record(
    new: list[int], out: list[list[int]], done: list[bool], cfg: GenerationConfig, stop: StopFn | None,
    on_token: TokenFn | None,
) -> None:  # fmt: skip
    for i, tok in enumerate(new):
        if done[i]:
            continue
        if cfg.eos_id is not None and tok == cfg.eos_id:
            done[i] = True
            continue
        out[i].append(tok)
        if on_token is not None:
            on_token(i, tok)
        if stop is not None and stop(i, out[i]):
            done[i] = True
