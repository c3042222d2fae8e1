"""Records -> training samples: token ids with a per-token loss flag, truncation counted.

A sample of ``n`` ids gives ``n - 1`` predictions: input ``ids[:-1]``, labels ``ids[1:]``, loss
where the label is a loss token. ``--loss-on``: ``assistant`` (chat; the mask of
:mod:`finetune.sft.masks`), ``completion`` (prompt/completion: the completion's tokens and EOS),
``all`` (every predicted token). A sample longer than ``--seq-length`` predictions is cut to
``seq_length + 1`` ids and counted; a sample left with no loss token is skipped and named (never
trained with loss on everything instead).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from finetune.sft.masks import ChatRenderer, Encoded
from finetune.sft.records import SFTRecord
from pretrain.tokenizer.base import Tokenizer
from pretrain.utils.errors import UserError

LossOn = Literal["assistant", "completion", "all"]
LOSS_ON: tuple[LossOn, ...] = ("assistant", "completion", "all")


@dataclass(frozen=True, kw_only=True)
class Sample:
    """``ids [n]`` (int64) and ``loss [n]`` (bool: the id is a loss target when predicted)."""

    ids: np.ndarray
    loss: np.ndarray

    @property
    def predictions(self) -> int:
        return len(self.ids) - 1


@dataclass(frozen=True, kw_only=True)
class SampleSet:
    """The samples of one file and what encoding did to its records."""

    samples: list[Sample]
    records: int
    truncated: int  # samples cut to --seq-length
    skipped: tuple[str, ...]  # FILE:LINE of records with no loss token (after truncation)

    @property
    def loss_tokens(self) -> int:
        return int(sum(int(s.loss[1:].sum()) for s in self.samples))


def check_loss_on(loss_on: LossOn, fmt: str, *, flag: str) -> None:
    """``assistant`` needs chat data and ``completion`` prompt/completion data (one line otherwise)."""
    if (loss_on, fmt) in (("assistant", "completion"), ("completion", "chat")):
        want = "chat ('messages')" if loss_on == "assistant" else "prompt/completion"
        raise UserError(f"--loss-on {loss_on} needs {want} records; {flag} holds {fmt} records")


def encode_completion(tok: Tokenizer, record: SFTRecord) -> Encoded:
    """BOS (when the tokenizer adds one), the prompt's ids, then the completion's and EOS (loss 1)."""
    bos = [tok.bos] if getattr(tok, "adds_bos", False) and tok.bos is not None else []
    prompt = bos + tok.tokenize(record.prompt)
    completion = tok.tokenize(record.completion) + ([tok.eod] if tok.eod is not None else [])
    return prompt + completion, [0] * len(prompt) + [1] * len(completion)


def encode_records(
    records: Sequence[SFTRecord], *, tokenizer: Tokenizer, renderer: ChatRenderer | None, loss_on: LossOn,
    seq_length: int, flag: str,
) -> SampleSet:  # fmt: skip
    """Encode, truncate and mask every record (see the module docstring)."""
    check_loss_on(loss_on, records[0].format, flag=flag)
    samples, skipped, truncated = [], [], 0
    for r in records:
        if r.format == "chat":
            assert renderer is not None
            ids, mask = renderer.encode(r.messages, r.where)
        else:
            ids, mask = encode_completion(tokenizer, r)
        if loss_on == "all":
            mask = [1] * len(ids)
        if len(ids) > seq_length + 1:
            ids, mask, truncated = ids[: seq_length + 1], mask[: seq_length + 1], truncated + 1
        if len(ids) < 2 or not any(mask[1:]):
            skipped.append(r.where)
            continue
        samples.append(Sample(ids=np.asarray(ids, dtype=np.int64), loss=np.asarray(mask, dtype=bool)))
    if not samples:
        raise UserError(
            f"{flag} {records[0].where.rsplit(':', 1)[0]}: no record has a loss token (--loss-on {loss_on})"
        )
    return SampleSet(samples=samples, records=len(records), truncated=truncated, skipped=tuple(skipped))
