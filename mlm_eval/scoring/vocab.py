"""Score hidden states of our GPT at selected positions only, exactly, under any TP degree.

Shared by the one-process :class:`~mlm_eval.scoring.megatron.MegatronGPTScorer` (TP group
``None``) and the ``torchrun`` :class:`~mlm_eval.scoring.parallel.ParallelGPTScorer`:

* :func:`score_hidden`: the tied output layer applied only to the given rows of hidden states,
  trimmed to the true vocabulary rows this TP rank holds, then :func:`vocab_parallel_nll_and_argmax`.
* :func:`invariant_width` and :func:`score_hidden_invariant`: the padding that makes a row's
  scores independent of its batch (``ROW_MULTIPLE``), used by the lm-evaluation-harness backend.

Log-probabilities are computed in float64 whatever the model's dtype (cast after the output
GEMM), so TP=1 and TP>1 agree to float64 rounding and padded vocabulary rows never count.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mlm_eval.scoring.scorer import ScoreOutput
from pretrain.models.forward_context import ForwardContext
from pretrain.models.gpt import GPTModel
from pretrain.parallel.state import ProcessGroup

# Hidden rows per output-layer chunk: bounds the float64 logits temporary to ~rows x V/t x 8 bytes.
SCORE_CHUNK_ROWS = 256
# GEMMs with fewer rows than this may take another kernel path (gemv, small-M code) whose
# rounding differs; batch-invariant scoring pads the trunk's width and the output layer's rows up
# to a multiple of it so that a row's scores do not depend on the rows batched with it.
ROW_MULTIPLE = 16
_NO_INDEX = torch.iinfo(torch.long).max


def scored_query_index(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """For ``mask [b, s]`` (True = scored): ``query_index [b, n]`` (each row's scored positions in
    order, short rows padded by repeating their last one) and ``valid [b, n]``; None when
    pruning cannot pay (some row scores more than half its columns, or none scores anything).

    ``hidden_at_index[valid]`` lists the same rows, in the same order, as ``hidden[mask]``.
    """
    counts = mask.sum(dim=1)
    n, s = int(counts.max()), mask.shape[1]
    if n == 0 or 2 * n > s:
        return None
    valid = torch.arange(n, device=mask.device)[None, :] < counts[:, None]
    order = torch.where(mask, torch.arange(s, device=mask.device), s).sort(dim=1).values[:, :n]
    last = order.gather(1, (counts - 1).clamp(min=0)[:, None])
    return torch.where(valid, order, last).clamp(max=s - 1), valid


def scored_hidden(
    model: GPTModel,
    mask: torch.Tensor,
    *,
    input_ids: torch.Tensor | None = None,
    hidden: torch.Tensor | None = None,
) -> torch.Tensor:
    """Final hidden states ``[m, h]`` at the ``m`` True positions of ``mask [b, s]`` (row-major) on
    the last stage. Rows scoring at most half their columns run the last layer only at their
    scored positions (:func:`scored_query_index`); rows scoring more (a WikiText stream's first
    window) run separately in full (not under expert parallelism, where the replicas' calls pair).
    Collectives: those of :meth:`GPTModel.trunk`, once per group."""
    dense = 2 * mask.sum(dim=1) > mask.shape[1]
    # with expert parallelism every trunk call is an all-to-all with the other replicas: one call
    if model.ps.ep_size > 1 or bool(dense.all()) or not bool(dense.any()):
        return _hidden_at(model, mask, input_ids, hidden)
    parts = [
        _hidden_at(model, mask[rows], None if input_ids is None else input_ids[rows],
                   None if hidden is None else hidden[rows])
        for rows in (dense, ~dense)
    ]  # fmt: skip
    from_dense = dense[:, None].expand_as(mask)[mask]
    out = parts[0].new_empty((len(from_dense), parts[0].shape[-1]))
    out[from_dense], out[~from_dense] = parts[0], parts[1]
    return out


def _hidden_at(
    model: GPTModel, mask: torch.Tensor, input_ids: torch.Tensor | None, hidden: torch.Tensor | None
) -> torch.Tensor:
    pruned = scored_query_index(mask)
    if pruned is None:
        return model.trunk(input_ids, hidden_states=hidden)[mask]
    index, valid = pruned
    return model.trunk(input_ids, hidden_states=hidden, ctx=ForwardContext(query_index=index))[valid]


def true_vocab_weight(model: GPTModel) -> torch.Tensor:
    """This TP rank's output weight ``[n, h]`` (tied or untied) without padded rows (``n`` may be 0)."""
    weight = model.output_weight()
    valid = max(0, min(weight.shape[0], model.cfg.vocab_size - model.vocab_start))
    return weight[:valid]


def score_hidden(model: GPTModel, hidden: torch.Tensor, targets: torch.Tensor) -> ScoreOutput:
    """NLL and argmax hit of ``targets [n]`` (all >= 0) from final hidden states ``hidden [n, h]``.

    Runs the output layer on ``SCORE_CHUNK_ROWS`` rows at a time (every TP rank has the same
    ``n``, so the chunks' collectives line up). Collectives: those of
    :func:`vocab_parallel_nll_and_argmax` per chunk, over ``model.ps.tp_group``.
    """
    weight = true_vocab_weight(model)
    nll = torch.zeros(targets.shape, dtype=torch.float64, device=hidden.device)
    hit = torch.zeros(targets.shape, dtype=torch.bool, device=hidden.device)
    for lo in range(0, targets.shape[0], SCORE_CHUNK_ROWS):
        rows = slice(lo, lo + SCORE_CHUNK_ROWS)
        logits = F.linear(hidden[rows], weight)
        out = vocab_parallel_nll_and_argmax(
            logits, targets[rows], vocab_start=model.vocab_start, group=model.ps.tp_group
        )
        nll[rows], hit[rows] = out.nll, out.is_argmax
    return ScoreOutput(nll=nll, is_argmax=hit)


def invariant_width(width: int, max_length: int) -> int:
    """The trunk's width for a batch whose scored columns end at ``width``: rounded up to a multiple
    of ``ROW_MULTIPLE`` (at most ``max_length``). The extra right padding is invisible to earlier
    positions under causal attention, and every GEMM then has ``b x multiple-of-16`` rows."""
    return min(-(-max(width, 1) // ROW_MULTIPLE) * ROW_MULTIPLE, max_length)


def score_hidden_invariant(model: GPTModel, hidden: torch.Tensor, targets: torch.Tensor) -> ScoreOutput:
    """:func:`score_hidden` on ``hidden [n, h]`` padded with zero rows to a multiple of
    ``ROW_MULTIPLE`` (so the output GEMM's row count never selects another kernel); results ``[n]``.
    Collectives: those of :func:`score_hidden` (every TP rank pads the same ``n``)."""
    n = hidden.shape[0]
    extra = -n % ROW_MULTIPLE
    rows = torch.cat([hidden, hidden.new_zeros((extra, hidden.shape[1]))])
    padded_targets = torch.cat([targets, targets.new_zeros(extra)])
    out = score_hidden(model, rows, padded_targets)
    return ScoreOutput(nll=out.nll[:n], is_argmax=out.is_argmax[:n])


def _all_reduce(x: torch.Tensor, group: ProcessGroup | None, op: dist.ReduceOp.RedOpType) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


def vocab_parallel_nll_and_argmax(
    logits: torch.Tensor, targets: torch.Tensor, *, vocab_start: int, group: ProcessGroup | None
) -> ScoreOutput:
    """Float64 ``-log softmax`` at ``targets [n]`` and ``targets == argmax`` from local logits.

    ``logits [n, v]`` are this TP rank's real vocabulary columns, global ids ``vocab_start ..
    vocab_start + v - 1`` (``v`` may be 0 on a rank holding only padding). The argmax breaks ties
    like ``torch.argmax`` on the gathered logits: the smallest global index among the maxima.
    The same math as :func:`pretrain.tensor_parallel.cross_entropy.vocab_parallel_cross_entropy`
    (which runs in float32), in float64, with the argmax sharing its max. Collectives over
    ``group``: all-reduce MAX of ``[n]``, all-reduce MIN of ``[n]``, all-reduce SUM of ``[2, n]``.
    """
    x = logits.to(torch.float64)
    n, v = x.shape
    if v:
        local_max, local_arg = x.max(dim=1)
    else:
        local_max = x.new_full((n,), float("-inf"))
        local_arg = torch.zeros(n, dtype=torch.long, device=x.device)
    global_max = _all_reduce(local_max.clone(), group, dist.ReduceOp.MAX)
    best = torch.where(local_max == global_max, local_arg + vocab_start, _NO_INDEX)
    best = _all_reduce(best, group, dist.ReduceOp.MIN)
    local = targets - vocab_start
    mine = (local >= 0) & (local < v)
    target_logit = torch.zeros(n, dtype=torch.float64, device=x.device)
    if v:
        picked = x.gather(1, local.clamp(0, v - 1)[:, None])[:, 0]
        target_logit = torch.where(mine, picked, 0.0)
    sums = torch.stack([(x - global_max[:, None]).exp().sum(dim=1), target_logit])
    sums = _all_reduce(sums, group, dist.ReduceOp.SUM)
    nll = sums[0].log() + global_max - sums[1]
    return ScoreOutput(nll=nll, is_argmax=best == targets)
