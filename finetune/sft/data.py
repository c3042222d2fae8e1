"""The SFT data of one run: ``--data``/``--valid-data`` read and checked line by line before the
model is read, then rendered, masked, truncated and laid into rows with the model's tokenizer."""

from __future__ import annotations

import argparse
import dataclasses

from finetune.sft.packing import Rows, pack_rows, pad_rows
from finetune.sft.records import SFTRecord, read_records
from finetune.sft.samples import LossOn, SampleSet, check_loss_on, encode_records
from finetune.sft.source import Decoder, hf_tokenizer
from finetune.sft.template import ChatTemplate, chat_template
from finetune.sft.tiny_tokenizer import SFT_CHAT_FILE, SFT_COMPLETION_FILE

BUILTIN_DATA = {"builtin:sft_chat": SFT_CHAT_FILE, "builtin:sft_completion": SFT_COMPLETION_FILE}


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTData:
    """Encoded training (and validation) data and how it was made."""

    train: SampleSet | None
    valid: SampleSet | None
    train_rows: Rows | None
    valid_rows: Rows | None
    template: ChatTemplate | None
    loss_on: str


def read_data(args: argparse.Namespace) -> tuple[dict[str, list[SFTRecord]], LossOn]:
    """The records this run uses (``--eval-only``: ``--valid-data``, else ``--data``; training:
    both), every line checked before the model is read, and the ``--loss-on`` they get."""
    flags: tuple[str, ...] = ("--data", "--valid-data")
    paths = {flag: getattr(args, flag[2:].replace("-", "_")) for flag in flags}
    if args.eval_only:
        flags = ("--valid-data",) if paths["--valid-data"] is not None else ("--data",)
    records = {
        f: read_records(BUILTIN_DATA.get(paths[f], paths[f]), flag=f) for f in flags if paths[f] is not None
    }
    first = next(iter(records.values()))[0].format
    loss_on: LossOn = args.loss_on or ("assistant" if first == "chat" else "completion")
    for flag, recs in records.items():
        check_loss_on(loss_on, recs[0].format, flag=flag)
    return records, loss_on


def encode_data(
    args: argparse.Namespace,
    records: dict[str, list[SFTRecord]],
    loss_on: LossOn,
    dec: Decoder,
    seq_length: int,
) -> SFTData:
    """Render, mask, truncate and lay out every file's records with ``dec``'s tokenizer."""
    from finetune.sft.masks import ChatRenderer

    renderer, template = None, None
    if any(r[0].format == "chat" for r in records.values()):
        hf = hf_tokenizer(dec.tokenizer)
        template = chat_template(hf, args.chat_template, tokenizer_source=f"the tokenizer of {dec.source}")
        renderer = ChatRenderer(hf, template)
    sets = {flag: encode_records(recs, tokenizer=dec.tokenizer, renderer=renderer, loss_on=loss_on,
                                 seq_length=seq_length, flag=flag) for flag, recs in records.items()}  # fmt: skip
    pad = next((i for i in (dec.tokenizer.pad, dec.tokenizer.eod) if i is not None), 0)
    layout = pack_rows if args.pack else pad_rows
    rows = {flag: layout(s.samples, seq_length, pad) for flag, s in sets.items()}
    train = None if args.eval_only else "--data"
    valid = "--valid-data" if "--valid-data" in sets else "--data" if args.eval_only else None
    return SFTData(train=sets.get(train or ""), valid=sets.get(valid or ""), train_rows=rows.get(train or ""),
                   valid_rows=rows.get(valid or ""), template=template, loss_on=loss_on)  # fmt: skip
