"""One rank's share of a harness run: the model stage, its scorer, tokenizer and DP position.

Loads ``ckpt`` through the evaluation's checkpoint loading (any layout and era, tokenizer from
the checkpoint): in one process (resharded in memory), or under ``torchrun`` as this rank's
TP shard of its pipeline stage, data parallel over ``world / (tp * pp)`` replicas.

:meth:`HarnessEngine.score` and :meth:`HarnessEngine.generate` take *all* rows/prompts on
every rank, sort them longest first, deal them round-robin to the data-parallel replicas (each
row is computed by exactly one replica, its model-parallel ranks together), and return every
result, in the caller's order, on every rank (all-gather over the data-parallel group).

Batch invariance (a row's score is bitwise the same whatever rows share its batch and whatever
``batch_size``): every forward pads the trunk's width and the output layer's rows to a multiple
of ``ROW_MULTIPLE`` (:class:`BatchInvariantScorer` in one process,
``ParallelGPTScorer(batch_invariant=True)`` under torchrun, the same padding), so every GEMM sees
``multiple-of-16`` rows and a row's arithmetic does not depend on its neighbours.

* One process, PP and DP: bitwise batch-invariant, and bitwise equal to one process (a pipeline
  stage runs exactly the one-process GEMMs on its layers; p2p copies are exact; tested pp2, dp2).
* TP = 2: bitwise batch-invariant (tested: ``tests/test_harness_backend.py``), equal to one
  process to fp32 rounding only (the row-parallel GEMMs sum two half-length dot products).
  Each TP all-reduce adds two operands, and ``a + b == b + a`` exactly in IEEE arithmetic.
* TP > 2: equal across batch sizes only to fp32 rounding (~1e-7 relative). Not the padding: the
  all-reduce. gloo's ring all-reduce splits the buffer into per-rank segments and accumulates
  each segment starting at a different rank (NCCL's ring/tree also order sums per chunk; not
  measured here, no GPUs), so an element's summation order
  (``((x0 + x1) + x2) + x3`` or ``((x2 + x3) + x0) + x1``...) depends on where it falls in the
  buffer, i.e. on ``b x w x h``: another batch size moves a row's activations to another
  segment. Measured at tp4 on gloo: batch 1 vs 7 and 1 vs 3 differ; with the all-reduce replaced
  by an all-gather summed in rank order they are bitwise equal. We do not ship that fixed-order
  all-reduce: it moves ``tp x`` the data of every TP all-reduce, for invariance below fp32 noise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist

from mlm_eval.harness.requests import Row, deal, length_order
from mlm_eval.scoring.scorer import DTYPE_FLAGS, LMScorer, ScoredRow, ScoreOutput, score_rows
from pretrain.inference.generate import GenerationConfig, StopFn, generate
from pretrain.models.gpt import GPTModel
from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.state import ParallelState
from pretrain.tokenizer.base import Tokenizer
from pretrain.tokenizer.factory import TokenizerConfig
from pretrain.utils.errors import UserError

if TYPE_CHECKING:
    from mlm_eval.scoring.megatron import TokenizerChoice

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Which checkpoint, how it is split (``parallel``) and where it runs."""

    ckpt: str
    parallel: ParallelConfig = ParallelConfig()
    device: str = "cpu"
    dtype: str = "float32"  # a pretrain.models.transformer.DTYPES name (or an mlm-eval flag: bf16)
    batch_size: int = 16  # rows per forward (per pipeline microbatch under PP)
    tokenizer: TokenizerConfig | TokenizerChoice | None = None  # None: the checkpoint's own
    progress: bool = True

    def __post_init__(self) -> None:
        if int(self.batch_size) < 1:
            raise UserError(f"model_args batch_size={self.batch_size}: must be >= 1")


class _ModelParallelOnly:
    """Hides a data-parallel scorer's DP methods: the engine deals rows to replicas itself."""

    def __init__(self, scorer: LMScorer) -> None:
        self.inner = scorer
        self.max_length = scorer.max_length
        self.vocab_size = scorer.vocab_size

    def score(self, input_ids: torch.Tensor, target_ids: torch.Tensor) -> ScoreOutput:
        return self.inner.score(input_ids, target_ids)


class BatchInvariantScorer:
    """One-process scorer whose per-row results do not depend on the batch.

    The trunk runs on ``[b, w]`` with ``w`` rounded up to a multiple of ``ROW_MULTIPLE``
    (:func:`~mlm_eval.scoring.vocab.invariant_width`), and the output layer on the scored hidden
    rows padded with zero rows to a multiple of ``ROW_MULTIPLE``
    (:func:`~mlm_eval.scoring.vocab.score_hidden_invariant`). Under torchrun the same padding is
    :class:`~mlm_eval.scoring.parallel.ParallelGPTScorer` with ``batch_invariant=True``.
    """

    def __init__(self, model: GPTModel) -> None:
        self.model = model.eval()
        self.max_length = model.cfg.max_position_embeddings
        self.vocab_size = model.cfg.vocab_size

    @torch.inference_mode()
    def score(self, input_ids: torch.Tensor, target_ids: torch.Tensor) -> ScoreOutput:
        from mlm_eval.scoring.megatron import scored_width
        from mlm_eval.scoring.vocab import invariant_width, score_hidden_invariant

        device = self.model.ps.device
        b, s = target_ids.shape
        nll = torch.zeros((b, s), dtype=torch.float64)
        hit = torch.zeros((b, s), dtype=torch.bool)
        width = scored_width(target_ids)
        if width == 0:
            return ScoreOutput(nll=nll, is_argmax=hit)
        padded = invariant_width(width, self.max_length)
        ids = torch.zeros((b, padded), dtype=torch.long)
        ids[:, : min(s, padded)] = input_ids[:, :padded]
        hidden = self.model.trunk(ids.to(device))[:, :width]
        mask = target_ids[:, :width] >= 0
        out = score_hidden_invariant(
            self.model, hidden[mask.to(device)], target_ids[:, :width][mask].to(device)
        )
        nll[:, :width][mask] = out.nll.cpu()
        hit[:, :width][mask] = out.is_argmax.cpu()
        return ScoreOutput(nll=nll, is_argmax=hit)


def _batch_stop(ids: list[int], stop: StopFn | None) -> StopFn:
    """``stop`` of a batch whose rows ``0..len(ids)-1`` are prompts ``ids`` and whose later rows
    are lockstep padding (stopped after their first token)."""

    def row_stop(row: int, toks: list[int]) -> bool:
        if row >= len(ids):
            return True
        return stop is not None and stop(ids[row], toks)

    return row_stop


def _seeds(ids: list[int], rows: int) -> list[int]:
    """Sampling seed offsets of a batch: each prompt's index; padding rows any (unused)."""
    return [*ids, *range(rows - len(ids))][:rows]


class HarnessEngine:
    """This rank's model stage with the scorer and tokenizer (see module docstring)."""

    def __init__(
        self,
        model: GPTModel,
        scorer: LMScorer,
        tokenizer: Tokenizer,
        *,
        batch_size: int,
        rows_per_call: int | None = None,
        info: dict[str, Any] | None = None,
        distributed: bool = False,
        progress: bool = True,
    ) -> None:
        self.model = model
        self.ps: ParallelState = model.ps
        self.scorer = _ModelParallelOnly(scorer)
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.rows_per_call = rows_per_call or batch_size
        self.distributed = distributed
        self.progress = progress
        self.info: dict[str, Any] = {**(info or {}), "layout": self.layout}
        self.is_main = self.ps.rank == 0

    @classmethod
    def load(cls, cfg: EngineConfig) -> HarnessEngine:
        """Load ``cfg.ckpt`` (one process, or this rank's shard under torchrun)."""
        from mlm_eval.scoring.megatron import MegatronGPTScorer, load_megatron_gpt
        from mlm_eval.scoring.parallel import launched_distributed, load_parallel_gpt

        dtype = DTYPE_FLAGS.get(cfg.dtype, cfg.dtype)
        if cfg.parallel.model_parallel_size > 1 or cfg.parallel.ep > 1 or launched_distributed():
            scorer, encoder, info, _ = load_parallel_gpt(
                cfg.ckpt,
                parallel=cfg.parallel,
                device=cfg.device,
                tokenizer_cfg=cfg.tokenizer,
                batch_size=cfg.batch_size,
                dtype=dtype,
                batch_invariant=True,
            )
            return cls(scorer.chunk, scorer, encoder.tokenizer, batch_size=cfg.batch_size,
                       rows_per_call=cfg.batch_size * scorer.microbatches_per_call, info={**info, "dtype": dtype},
                       distributed=True, progress=cfg.progress)  # fmt: skip
        one, encoder, info = load_megatron_gpt(
            cfg.ckpt, tokenizer_cfg=cfg.tokenizer, batch_size=cfg.batch_size, device=cfg.device, dtype=dtype
        )
        assert isinstance(one, MegatronGPTScorer)
        return cls(one.model, BatchInvariantScorer(one.model), encoder.tokenizer, batch_size=cfg.batch_size, info={**info, "dtype": dtype},
                   progress=cfg.progress)  # fmt: skip

    @property
    def layout(self) -> str:
        from mlm_eval.scoring.parallel import layout_name

        return layout_name(self.ps)

    @property
    def max_length(self) -> int:
        return int(self.model.cfg.max_position_embeddings)

    def score(self, rows: Sequence[Row], *, desc: str = "scoring") -> list[ScoredRow]:
        """Every row's scored NLLs/argmax hits, in order, on every rank (each row scored once)."""
        from mlm_eval.scoring.parallel import lockstep_padding

        mine = deal(length_order([len(inp) for inp, _ in rows]), self.ps.dp_size, self.ps.dp_rank)
        padding: list[Row] = [([0], [0])] * lockstep_padding(
            self.ps, len(rows), len(mine)
        )  # EP: paired forwards
        local = score_rows(self.scorer, [*(rows[i] for i in mine), *padding], batch_size=self.rows_per_call,
                           desc=desc, progress=self.progress and self.is_main)  # fmt: skip
        return self._gather(len(rows), mine, local[: len(mine)])

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        gen: GenerationConfig,
        *,
        stop: StopFn | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> list[list[int]]:
        """Generated ids per prompt, in order, on every rank. ``stop(i, ids)``: prompt ``i`` is done.

        Prompts are batched ``batch_size`` at a time, longest first; row ``i`` samples with seed
        offset ``i`` so its tokens do not depend on its batch. With expert parallelism every
        replica makes the same :func:`generate` calls (the expert all-to-alls pair them): a replica
        with fewer prompts adds one-token rows (:func:`lockstep_padding`), marked done at once and
        dropped, and :func:`generate` steps the replicas together.
        """
        from mlm_eval.scoring.parallel import lockstep_padding

        mine = deal(length_order([len(p) for p in prompts]), self.ps.dp_size, self.ps.dp_rank)
        rows: list[Sequence[int]] = [prompts[i] for i in mine]
        rows += [[gen.pad_id]] * lockstep_padding(self.ps, len(prompts), len(mine))
        local: list[list[int]] = []
        step = self.batch_size
        for lo in range(0, len(rows), step):
            batch, ids = rows[lo : lo + step], mine[lo : lo + step]  # rows past ids: padding
            row_stop = _batch_stop(ids, stop) if stop is not None or len(ids) < len(batch) else None
            local += generate(self.model, batch, gen, stop=row_stop, seeds=_seeds(ids, len(batch)))
            if progress is not None:
                progress(len(ids) * self.ps.dp_size)
        return self._gather(len(prompts), mine, local[: len(mine)])

    def _gather(self, n: int, mine: list[int], local: list[T]) -> list[T]:
        """All replicas' results placed at their original indices (all-gather over dp_group)."""
        parts: list[Any] = [(mine, local)]
        if self.ps.dp_group is not None and self.ps.dp_size > 1:
            parts = [None] * self.ps.dp_size
            dist.all_gather_object(parts, (mine, local), group=self.ps.dp_group)
        out: list[Any] = [None] * n
        for idx, res in parts:
            for i, r in zip(idx, res, strict=True):
                out[i] = r
        assert all(r is not None for r in out), "a row was scored by no replica"
        return out

    def close(self) -> None:
        """Release the process group this engine created under torchrun."""
        if self.distributed and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
