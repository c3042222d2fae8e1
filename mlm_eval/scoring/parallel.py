"""Evaluation under ``torchrun``: tensor, pipeline and data parallelism (TP x PP x DP ranks).

Launch, e.g. TP=2 on 2 processes, or PP=2 x DP=2 on 4::

    torchrun --standalone --nproc-per-node 2 -m mlm_eval.cli wikitext103 --ckpt DIR --data PATH \\
        --tensor-model-parallel-size 2

Every rank reads the canonical checkpoint tensors and keeps its shard of its stage
(:func:`pretrain.pipeline.partition.build_model_chunks`, :func:`load_full_state_dict`). Every
rank builds the same rows; data-parallel replica ``d`` scores the ``d``-th contiguous slice
(:meth:`ParallelGPTScorer.local_rows`) with the forward-only pipeline schedule; the last stage
scores only the target positions, with vocab-parallel float64 NLL/argmax
(:mod:`mlm_eval.scoring.vocab`); results go to the other stages (broadcast over the pipeline
group) and to every replica (all-gather over the data-parallel group), so each row is counted
exactly once. Rank 0 prints and writes the result.

Mixture-of-experts checkpoints may split their experts over ``--ep`` ranks (carved out of the
data-parallel replicas, megatron-core's layout; ``--etp`` 1 or TP): each rank reads only its
experts (:class:`~pretrain.checkpoint.expert_layout.ExpertShare`: legacy files of other EP ranks
are not opened, ``torch_dist`` regions of other experts not read; the weights fingerprint joins
every rank's tensor digests) and tokens reach them by the training all-to-all
(:mod:`pretrain.models.moe.dispatch`). The all-to-alls pair every forward of the replicas of an
expert-parallel group, so each replica scores the same number of rows (:func:`lockstep_padding`
dummy rows, whose results are dropped).

``batch_invariant=True`` (the lm-evaluation-harness backend, :mod:`mlm_eval.harness.engine`):
microbatches padded to a width that is a multiple of ``ROW_MULTIPLE``, the last layer at every
position and the output layer on zero-padded rows, so a row's scores do not depend on its batch.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from mlm_eval.scoring.megatron import (
    PretrainTextEncoder,
    TokenizerChoice,
    eval_model_config,
    read_gpt_checkpoint,
    scored_width,
)
from mlm_eval.scoring.scorer import IGNORE, ScoredRow, ScoreOutput
from mlm_eval.scoring.vocab import (
    invariant_width,
    score_hidden,
    score_hidden_invariant,
    scored_hidden,
)
from pretrain.checkpoint.expert_layout import ExpertShare
from pretrain.checkpoint.fingerprint import combine_digests
from pretrain.models.base import ShardedModule
from pretrain.models.gpt import GPTModel
from pretrain.models.moe.dispatch import check_expert_parallel
from pretrain.models.sharding import load_full_state_dict
from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.layout import check_expert_sizes
from pretrain.parallel.state import ParallelState
from pretrain.pipeline.partition import build_model_chunks
from pretrain.pipeline.schedules import Microbatch, forward_backward
from pretrain.tokenizer.factory import TokenizerConfig
from pretrain.utils.errors import UserError


def launched_distributed() -> bool:
    """True under ``torchrun`` with more than one process (or an initialised process group)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 or dist.is_initialized()


def setup_eval_parallel(cfg: ParallelConfig, *, device: str = "cpu") -> ParallelState:
    """Initialise ``torch.distributed`` (gloo on ``device`` ``cpu``, NCCL on ``cuda``: one GPU per
    local rank) and build the groups of the layout ``cfg``.

    Collective: ``init_process_group`` and every group's ``new_group`` on all ranks.
    """
    # an initialised group (a caller's, or tests' forked ranks without torchrun's WORLD_SIZE) counts
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    if not dist.is_initialized() and world == 1:
        if cfg.ep > 1 and cfg.model_parallel_size == 1:
            raise UserError(f"--expert-model-parallel-size {cfg.ep} needs {cfg.ep} processes: launch with torchrun "
                            f"--nproc-per-node {cfg.ep}")  # fmt: skip
        raise UserError(
            f"--tensor-model-parallel-size {cfg.tp} x --pipeline-model-parallel-size {cfg.pp} needs "
            f"{cfg.model_parallel_size} processes: launch with torchrun --nproc-per-node {cfg.model_parallel_size}"
        )
    cfg.check_expert_engine()
    check_expert_sizes(world, cfg.tp, cfg.pp, cfg.ep, cfg.expert_tp)  # before any process group
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    cfg.data_parallel_size(dist.get_world_size())  # the world splits into whole replicas
    here = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return ParallelState.from_distributed(cfg, device=here)


class ParallelGPTScorer:
    """:class:`~mlm_eval.scoring.scorer.DataParallelScorer` over this rank's GPT stage (one chunk).

    ``score`` must be called with the same rows on every rank of a model-parallel group; it
    returns the full results on all of them. Collectives: p2p over the pipeline group, the TP
    collectives of the forward and of the scoring, a broadcast over the pipeline group, and (in
    :meth:`gather_rows`) an all-gather over the data-parallel group.
    """

    def __init__(
        self, chunk: GPTModel, ps: ParallelState, *, batch_size: int, batch_invariant: bool = False
    ) -> None:
        self.chunk = chunk.eval()
        self.ps = ps
        self.batch_size = batch_size
        self.batch_invariant = batch_invariant
        self.max_length = chunk.cfg.max_position_embeddings
        self.vocab_size = chunk.cfg.vocab_size
        self.is_main = ps.rank == 0
        self.microbatches_per_call = 2 * ps.pp_size  # keeps every stage busy in the 1F1B schedule

    def local_rows(self, num_rows: int) -> range:
        """Replica ``d`` of ``D`` gets rows ``[d*n/D, (d+1)*n/D)`` (sizes differ by at most one)."""
        d, size = self.ps.dp_rank, self.ps.dp_size
        return range(d * num_rows // size, (d + 1) * num_rows // size)

    def padding_rows(self, num_rows: int) -> int:
        """Dummy rows this replica scores after its :meth:`local_rows` (see :func:`lockstep_padding`)."""
        return lockstep_padding(self.ps, num_rows, len(self.local_rows(num_rows)))

    def gather_rows(self, local: list[ScoredRow]) -> list[ScoredRow]:
        """Concatenate every replica's rows in data-parallel rank order (all-gather over dp_group)."""
        if self.ps.dp_group is None:
            return local
        parts: list[Any] = [None] * self.ps.dp_size
        dist.all_gather_object(parts, local, group=self.ps.dp_group)
        return [row for part in parts for row in part]

    @torch.inference_mode()
    def score(self, input_ids: torch.Tensor, target_ids: torch.Tensor) -> ScoreOutput:
        """Score the rows ``batch_size`` at a time as microbatches of one pipeline schedule."""
        if input_ids.shape != target_ids.shape or input_ids.ndim != 2:
            raise ValueError(f"input {tuple(input_ids.shape)} and target {tuple(target_ids.shape)} differ")
        microbatches = [
            self._microbatch(input_ids[lo : lo + self.batch_size], target_ids[lo : lo + self.batch_size])
            for lo in range(0, input_ids.shape[0], self.batch_size)
        ]
        outputs = None
        if self.ps.is_last_stage:
            outputs = self._run(microbatches)
        else:
            self._run(microbatches)
        if self.ps.pp_group is not None:
            box = [outputs]
            dist.broadcast_object_list(box, src=self.ps.pp_ranks[-1], group=self.ps.pp_group)
            outputs = box[0]
        assert outputs is not None
        return self._assemble(microbatches, outputs, target_ids.shape)

    def _microbatch(self, input_ids: torch.Tensor, target_ids: torch.Tensor) -> Microbatch:
        """Tokens and targets ``[b, w]``: ``w`` the scored width (at least one column), or under
        ``batch_invariant`` that rounded up by :func:`invariant_width` (padding: token 0, no target)."""
        width = max(scored_width(target_ids), 1)  # a row scoring nothing still needs one column
        if not self.batch_invariant:
            return {"tokens": input_ids[:, :width], "targets": target_ids[:, :width]}
        padded = invariant_width(width, self.max_length)
        b, s = target_ids.shape
        tokens = torch.zeros((b, padded), dtype=input_ids.dtype)
        targets = torch.full((b, padded), IGNORE, dtype=target_ids.dtype)
        tokens[:, : min(s, padded)] = input_ids[:, :padded]
        targets[:, : min(s, padded)] = target_ids[:, :padded]
        return {"tokens": tokens, "targets": targets}

    def _run(self, microbatches: list[Microbatch]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        ps = self.ps
        placed = [{k: v.to(ps.device) for k, v in mb.items()} for mb in microbatches]
        _, outputs = forward_backward(
            chunks=[self.chunk],
            ps=ps,
            microbatches=placed,
            loss_fn=lambda out, mb: out[0].sum(),
            forward_only=True,
            collect_outputs=True,
            forward_step=_invariant_forward_step if self.batch_invariant else _forward_step,
        )
        return [(nll.cpu(), hit.cpu()) for nll, hit in outputs]

    @staticmethod
    def _assemble(
        microbatches: list[Microbatch], outputs: list[tuple[torch.Tensor, torch.Tensor]], shape: torch.Size
    ) -> ScoreOutput:
        nll = torch.zeros(shape, dtype=torch.float64)
        hit = torch.zeros(shape, dtype=torch.bool)
        row = 0
        for mb, (mb_nll, mb_hit) in zip(microbatches, outputs, strict=True):
            b, width = mb["targets"].shape
            width = min(width, shape[1])  # batch-invariant padding may run past the rows' length
            mask = mb["targets"][:, :width] >= 0
            nll[row : row + b, :width][mask] = mb_nll
            hit[row : row + b, :width][mask] = mb_hit
            row += b
        return ScoreOutput(nll=nll, is_argmax=hit)


def _forward_step(
    model: ShardedModule, mb: Microbatch, hidden: torch.Tensor | None, is_last: bool
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One stage: hidden states ``[b, s, h]`` to send on, or ``(nll [n], hit [n])`` at the targets."""
    assert isinstance(model, GPTModel)
    input_ids = mb["tokens"] if hidden is None else None
    if not is_last:
        return model.trunk(input_ids, hidden_states=hidden)
    mask = mb["targets"] >= 0
    out = scored_hidden(model, mask, input_ids=input_ids, hidden=hidden)
    scored = score_hidden(model, out, mb["targets"][mask])
    return scored.nll, scored.is_argmax


def _invariant_forward_step(
    model: ShardedModule, mb: Microbatch, hidden: torch.Tensor | None, is_last: bool
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`_forward_step` for ``batch_invariant``: the last layer runs at every position (its row
    count ``b x w`` stays a multiple of ``ROW_MULTIPLE``; pruning to the scored positions would
    make it depend on the batch), and the output layer on zero-padded rows."""
    assert isinstance(model, GPTModel)
    input_ids = mb["tokens"] if hidden is None else None
    out = model.trunk(input_ids, hidden_states=hidden)
    if not is_last:
        return out
    mask = mb["targets"] >= 0
    scored = score_hidden_invariant(model, out[mask], mb["targets"][mask])
    return scored.nll, scored.is_argmax


def lockstep_padding(ps: ParallelState, num_rows: int, mine: int) -> int:
    """Rows to add to this replica's ``mine`` of ``num_rows`` so that all replicas score
    ``ceil(num_rows / D)``: with expert parallelism every forward is a collective over replicas
    (the token all-to-all), so they must make the same calls. 0 without expert parallelism."""
    if ps.ep_size == 1:
        return 0
    return -(-num_rows // ps.dp_size) - mine


def layout_name(ps: ParallelState) -> str:
    """``tp{T}-pp{P}-dp{D}`` for a result record, with ``-ep{E}`` (and ``-etp{ETP}`` when not TP)."""
    name = f"tp{ps.tp_size}-pp{ps.pp_size}-dp{ps.dp_size}"
    if ps.ep_size > 1:
        name += f"-ep{ps.ep_size}"
    if ps.etp_size != ps.tp_size:
        name += f"-etp{ps.etp_size}"
    return name


def gathered_fingerprint(digests: dict[str, bytes]) -> str:
    """The weights fingerprint of tensors read in parts: every rank's digests joined (collective:
    an all-gather of the digests over the world; a tensor read by several ranks has one digest)."""
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, digests)
    joined: dict[str, bytes] = {}
    for part in parts:
        for name, digest in part.items():
            if joined.setdefault(name, digest) != digest:
                raise UserError(f"tensor {name}: read differently by two ranks (the checkpoint changed?)")
    return combine_digests(joined)


def load_parallel_gpt(
    ckpt: str,
    *,
    parallel: ParallelConfig,
    device: str = "cpu",
    tokenizer_cfg: TokenizerChoice | TokenizerConfig | None,
    batch_size: int,
    dtype: str = "float32",
    batch_invariant: bool = False,
) -> tuple[ParallelGPTScorer, PretrainTextEncoder, dict[str, Any], ParallelState]:
    """This rank's scorer, the text encoder, the model info and the parallel state (``parallel``'s
    layout on ``device``).

    Collectives: :func:`setup_eval_parallel`; loading itself needs none (each rank shards the
    canonical tensors it read).
    """
    ps = setup_eval_parallel(parallel, device=device)
    share = ExpertShare(rank=ps.ep_rank, size=ps.ep_size) if ps.ep_size > 1 else None
    read = read_gpt_checkpoint(ckpt, tokenizer_cfg=tokenizer_cfg, experts=share)
    if share is not None:
        read.info["fingerprint"] = gathered_fingerprint(read.digests)
    cfg = eval_model_config(read.cfg, dtype)
    if cfg.num_layers % ps.pp_size:
        raise UserError(
            f"--pipeline-model-parallel-size {ps.pp_size}: {cfg.num_layers} layers do not split evenly"
        )
    cfg.check_tensor_parallel(ps.tp_size)
    try:
        check_expert_parallel(cfg, ps.ep_size, etp=ps.etp_size, tp=ps.tp_size)
    except UserError as exc:  # the checkpoint's expert count against the flags
        raise UserError(f"--ckpt {ckpt}: {exc}") from None
    (chunk,) = build_model_chunks(cfg, ps)
    assert isinstance(chunk, GPTModel)
    load_full_state_dict(chunk, read.full)
    if isinstance(read.full, dict):  # other EP ranks' experts and other stages' layers are not kept
        read.full.clear()
    scorer = ParallelGPTScorer(chunk, ps, batch_size=batch_size, batch_invariant=batch_invariant)
    return scorer, PretrainTextEncoder(read.tokenizer), read.info, ps
