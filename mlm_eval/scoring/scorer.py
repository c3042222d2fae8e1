"""The scoring interface the evaluations run against, and a Hugging Face causal-LM adapter.

An evaluation never sees a model: it hands token batches to an :class:`LMScorer` and gets back,
per target position, the negative log-probability of the target and whether the target is the
argmax. Both are taken over the *true* vocabulary only, so padded vocabulary rows (Megatron pads
the embedding to a multiple of 128 x TP) can neither absorb probability mass nor win the argmax.

Convention shared by every scorer: a negative target id marks a position that is not scored
(context, or right padding); its ``nll`` is 0 and ``is_argmax`` False, and a scorer may skip the
output layer there (with overlapping windows most positions are context).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from tqdm import tqdm

IGNORE = -1  # target id of a position that is not scored

# ``--dtype`` flag values -> torch dtype names (pretrain.models.transformer.DTYPES keys).
DTYPE_FLAGS = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}

# Positions per float64 log-softmax chunk: bounds the temporary to ~chunk x vocab x 8 bytes.
_LOGSOFTMAX_CHUNK = 256


@dataclass(frozen=True, kw_only=True)
class ScoreOutput:
    """Per-position results of :meth:`LMScorer.score`, both of shape ``[b, s]``."""

    nll: torch.Tensor  # float64 (or float32): -log p(target | inputs up to this position)
    is_argmax: torch.Tensor  # bool: target == argmax over the true vocabulary (torch.argmax ties)


@runtime_checkable
class LMScorer(Protocol):
    """A causal language model seen as a scorer of next tokens."""

    max_length: int  # the most input positions one row may have
    vocab_size: int  # the true vocabulary size (no padding rows)

    def score(self, input_ids: torch.Tensor, target_ids: torch.Tensor) -> ScoreOutput:
        """Score ``target_ids[i, j]`` given ``input_ids[i, : j + 1]`` (negative targets: not scored)."""
        ...


@runtime_checkable
class DataParallelScorer(LMScorer, Protocol):
    """An :class:`LMScorer` that is one of several data-parallel replicas (under ``torchrun``).

    :func:`score_rows` gives each replica the contiguous slice :meth:`local_rows` of the rows,
    scores it, and :meth:`gather_rows` concatenates the slices in rank order on every rank.
    """

    is_main: bool  # the rank that shows progress and writes results
    microbatches_per_call: int  # rows per ``score`` call = batch_size x this (pipeline depth)

    def local_rows(self, num_rows: int) -> range:
        """This replica's contiguous slice of ``range(num_rows)``."""
        ...

    def padding_rows(self, num_rows: int) -> int:
        """Dummy rows to score after the slice, so that every replica makes the same forward calls."""
        ...

    def gather_rows(self, local: list[ScoredRow]) -> list[ScoredRow]:
        """All replicas' results in row order (a collective over the data-parallel group)."""
        ...


@runtime_checkable
class TextEncoder(Protocol):
    """The tokenizer side the evaluations need: text to ids, and a document-start token."""

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` with no special tokens added."""
        ...

    @property
    def prefix_token_id(self) -> int | None:
        """The token put before a document so its first token can be scored (lm-eval's rule)."""
        ...


class HFTextEncoder:
    """:class:`TextEncoder` over a ``transformers`` tokenizer (no special tokens added)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; ``verbose=False`` silences the too-long-for-the-model warning."""
        return list(self.tokenizer.encode(text, add_special_tokens=False, verbose=False))

    @property
    def prefix_token_id(self) -> int | None:
        """BOS if the tokenizer has one, else EOS (lm-evaluation-harness ``HFLM.prefix_token_id``)."""
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def adds_bos(self) -> bool:
        """The tokenizer's convention puts BOS before a document (Llama), see :func:`document_prefix`."""
        from pretrain.tokenizer.hf import hf_adds_bos

        return hf_adds_bos(self.tokenizer)

    def __len__(self) -> int:
        return len(self.tokenizer)


def document_prefix(encoder: TextEncoder) -> list[int]:
    """``[BOS]`` when the tokenizer's convention puts BOS before a document (an ``adds_bos``
    attribute: Llama's SentencePiece, ``add_bos_token`` tokenizers), else ``[]`` (GPT-2).

    WikiText (paper method) and LAMBADA put it before the text they score, as the model saw in
    training; the result record says which (``details.bos``).
    """
    if not getattr(encoder, "adds_bos", False) or encoder.prefix_token_id is None:
        return []
    return [int(encoder.prefix_token_id)]


def as_text_encoder(tokenizer: Any) -> TextEncoder:
    """Wrap a ``transformers`` tokenizer; objects already implementing :class:`TextEncoder` pass through."""
    if not any(cls.__module__.startswith("transformers") for cls in type(tokenizer).__mro__):
        return tokenizer  # type: ignore[no-any-return]  # ours: no need to import transformers
    from transformers import PreTrainedTokenizerBase  # lazy: transformers is slow to import

    if isinstance(tokenizer, PreTrainedTokenizerBase):
        return HFTextEncoder(tokenizer)
    return tokenizer  # type: ignore[no-any-return]


def nll_and_argmax(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int) -> ScoreOutput:
    """NLL and argmax test of ``targets`` ``[n]`` under ``logits`` ``[n, V_padded]`` in float64.

    Rows whose target is negative get nll 0 and is_argmax False. Casting to float64 is exact for
    fp32/bf16/fp16 logits, so the argmax (and its tie-breaking) equals torch.argmax on the originals.
    """
    nll = torch.zeros(targets.shape, dtype=torch.float64)
    hit = torch.zeros(targets.shape, dtype=torch.bool)
    safe = targets.clamp(min=0)
    for lo in range(0, logits.shape[0], _LOGSOFTMAX_CHUNK):
        hi = lo + _LOGSOFTMAX_CHUNK
        chunk = logits[lo:hi, :vocab_size].to(torch.float64)
        tgt = safe[lo:hi].to(chunk.device)
        logp = chunk.gather(1, tgt[:, None])[:, 0] - torch.logsumexp(chunk, dim=1)
        nll[lo:hi] = (-logp).cpu()
        hit[lo:hi] = (chunk.argmax(dim=1) == tgt).cpu()
    scored = targets >= 0
    return ScoreOutput(nll=torch.where(scored, nll, 0.0), is_argmax=hit & scored)


class HFCausalLMScorer:
    """:class:`LMScorer` over a ``transformers`` causal LM (e.g. ``GPT2LMHeadModel``).

    Rows are run ``batch_size`` at a time in inference mode without an attention mask: callers pad
    on the right, and causal attention keeps pads from influencing earlier positions. Only the
    positions some row scores go through the output layer when the model accepts a tensor
    ``logits_to_keep`` (transformers >= 4.50); log-softmax is float64 over the true vocabulary.
    """

    def __init__(
        self,
        model: Any,
        *,
        max_length: int | None = None,
        batch_size: int = 8,
        vocab_size: int | None = None,
    ) -> None:
        config = model.config
        model_vocab = int(config.vocab_size)
        self.model = model.eval()
        self.vocab_size = int(vocab_size) if vocab_size is not None else model_vocab
        if not 0 < self.vocab_size <= model_vocab:
            raise ValueError(f"vocab_size {self.vocab_size} must be in 1..{model_vocab} (the model's)")
        positions = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
        self.max_length = int(max_length or positions or 1024)
        if positions and self.max_length > positions:
            raise ValueError(f"max_length {self.max_length} exceeds the model's {positions} positions")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        self._keep_param = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.device = next(model.parameters()).device

    def score(self, input_ids: torch.Tensor, target_ids: torch.Tensor) -> ScoreOutput:
        """Score each non-negative target; see :class:`LMScorer`."""
        if input_ids.shape != target_ids.shape or input_ids.ndim != 2:
            raise ValueError(f"input {tuple(input_ids.shape)} and target {tuple(target_ids.shape)} differ")
        if input_ids.shape[1] > self.max_length:
            raise ValueError(f"{input_ids.shape[1]} positions exceed max_length {self.max_length}")
        nll = torch.zeros(target_ids.shape, dtype=torch.float64)
        hit = torch.zeros(target_ids.shape, dtype=torch.bool)
        for lo in range(0, input_ids.shape[0], self.batch_size):
            rows = slice(lo, lo + self.batch_size)
            out = self._score_rows(input_ids[rows], target_ids[rows])
            nll[rows], hit[rows] = out.nll, out.is_argmax
        return ScoreOutput(nll=nll, is_argmax=hit)

    @torch.inference_mode()
    def _score_rows(self, input_ids: torch.Tensor, target_ids: torch.Tensor) -> ScoreOutput:
        b, s = target_ids.shape
        cols = (target_ids >= 0).any(dim=0).nonzero().squeeze(1)
        nll = torch.zeros((b, s), dtype=torch.float64)
        hit = torch.zeros((b, s), dtype=torch.bool)
        if cols.numel() == 0:
            return ScoreOutput(nll=nll, is_argmax=hit)
        kwargs: dict[str, Any] = {"use_cache": False}
        if self._keep_param:
            kwargs["logits_to_keep"] = cols.to(self.device)
        logits = self.model(input_ids.to(self.device), **kwargs).logits
        if not self._keep_param:
            logits = logits[:, cols.to(logits.device)]
        targets = target_ids[:, cols]
        flat = nll_and_argmax(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), self.vocab_size)
        nll[:, cols] = flat.nll.view(b, -1)
        hit[:, cols] = flat.is_argmax.view(b, -1)
        return ScoreOutput(nll=nll, is_argmax=hit)


@dataclass(frozen=True, kw_only=True)
class ScoredRow:
    """The scored positions of one row, in order: their NLLs and argmax hits."""

    nll: list[float]
    is_argmax: list[bool]


def score_rows(
    scorer: LMScorer,
    rows: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    batch_size: int,
    desc: str = "scoring",
    progress: bool = True,
) -> list[ScoredRow]:
    """Score ``(input_ids, target_ids)`` rows ``batch_size`` at a time, padded on the right.

    ``target_ids`` has one entry per input (``IGNORE`` where not scored). Pads are input id 0 with
    target ``IGNORE`` after the real tokens, so they cannot change a row's results. The bar counts
    scored tokens, so its rate is tokens/s. A :class:`DataParallelScorer` scores only its slice
    of the rows and gathers the others' (each row is scored exactly once over all replicas).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not isinstance(scorer, DataParallelScorer):
        return _score_local(scorer, rows, batch_size=batch_size, desc=desc, progress=progress)
    part = scorer.local_rows(len(rows))
    # dummy rows (one scored token, dropped) keep expert-parallel replicas' forwards paired
    padding = [([0], [0])] * scorer.padding_rows(len(rows))
    local = _score_local(
        scorer,
        [*rows[part.start : part.stop], *padding],
        batch_size=batch_size * scorer.microbatches_per_call,
        desc=desc,
        progress=progress and scorer.is_main,
    )
    return scorer.gather_rows(local[: len(part)])


def _score_local(
    scorer: LMScorer,
    rows: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    batch_size: int,
    desc: str,
    progress: bool,
) -> list[ScoredRow]:
    total = sum(sum(1 for t in tgt if t >= 0) for _, tgt in rows)
    results: list[ScoredRow] = []
    with tqdm(
        total=total, desc=desc, unit="tok", disable=None if progress else True, dynamic_ncols=True
    ) as bar:
        for lo in range(0, len(rows), batch_size):
            batch = rows[lo : lo + batch_size]
            width = max(len(inp) for inp, _ in batch)
            inputs = torch.zeros((len(batch), width), dtype=torch.long)
            targets = torch.full((len(batch), width), IGNORE, dtype=torch.long)
            for i, (inp, tgt) in enumerate(batch):
                if len(inp) != len(tgt):
                    raise ValueError(f"row {lo + i}: {len(inp)} inputs but {len(tgt)} targets")
                inputs[i, : len(inp)] = torch.as_tensor(list(inp), dtype=torch.long)
                targets[i, : len(tgt)] = torch.as_tensor(list(tgt), dtype=torch.long)
            out = scorer.score(inputs, targets)
            mask = targets >= 0
            for i in range(len(batch)):
                results.append(
                    ScoredRow(
                        nll=out.nll[i][mask[i]].double().tolist(),
                        is_argmax=out.is_argmax[i][mask[i]].tolist(),
                    )
                )
            bar.update(int(mask.sum()))
    return results
