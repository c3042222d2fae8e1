"""``mlm-convert inspect``: describe a checkpoint and check it across shards (a table, or one JSON object)."""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Any

from pretrain.utils.errors import UserError

if TYPE_CHECKING:
    from pretrain.checkpoint.types import TensorSource
    from tools.convert.source import SourceOptions


def verify(reader: TensorSource) -> list[str]:
    """Assemble every tensor (shapes, replicated copies, tied head): the problems found."""
    problems = []
    for name in reader.names():
        try:
            reader.tensor(name)
        except UserError as exc:
            problems.append(str(exc))
    return problems


def run_inspect(source: SourceOptions, *, as_json: bool) -> int:
    from pretrain.checkpoint.optimizer.reshard import describe_optimizer

    reader, given = source.open()
    problems = verify(reader)
    tokenizer = None
    try:  # the tokenizer the checkpoint carries (or names) must fit the model
        tok = source.tokenizer(reader, required=False, given=given)
        if tok is not None:
            tokenizer = {
                "source": tok.source,
                "type": tok.record.tokenizer_type,
                "vocab_size": tok.record.vocab_size,
            }
    except UserError as exc:
        problems.append(str(exc))
    info = dataclasses.asdict(reader.info)
    meta = reader.metadata
    record = {
        **info,
        "ok": not problems,
        "problems": problems,
        "model_config": dataclasses.asdict(reader.spec.cfg),
        "tokenizer": tokenizer,
        "provenance": None if meta is None else dataclasses.asdict(meta.provenance),
        "optimizer": describe_optimizer(reader),
    }
    if as_json:
        print(json.dumps(record, default=str))
    else:
        _print_inspect(record)
    return 0 if not problems else 1


def _print_inspect(record: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    from pretrain.checkpoint.fingerprint import short_fingerprint

    table = Table(title=f"checkpoint {record['path']}", show_header=False)
    for key in ("format", "kind", "iteration", "checkpoint_version", "tp", "pp", "vp", "ep", "vocab_size",
                "vocab_source", "padded_vocab_size", "num_parameters", "dtypes", "ours", "tokenizer"):  # fmt: skip
        table.add_row(key, str(record[key]))
    cfg = record["model_config"]
    table.add_row(
        "model", ", ".join(f"{k}={cfg[k]}" for k in ("num_layers", "hidden_size", "num_attention_heads"))
    )
    prov = record["provenance"] or {}
    if prov.get("weights_fingerprint"):  # the full string is in --json
        table.add_row("weights_fingerprint", short_fingerprint(str(prov["weights_fingerprint"])))
    if prov.get("data_hash"):
        table.add_row("data_hash", str(prov["data_hash"]))
    opt = record["optimizer"]
    table.add_row("optimizer", f"step {opt['step']}, reshardable (--with-optimizer)" if opt["reshardable"]
                  else f"not carried: {opt['why']}" if opt["present"] else "none")  # fmt: skip
    console = Console()
    console.print(table)
    for p in record["problems"]:
        console.print(f"[red]problem:[/red] {p}", highlight=False)
    verdict = (
        "[green]consistent[/green]"
        if record["ok"]
        else f"[red]INCONSISTENT ({len(record['problems'])})[/red]"
    )
    console.print(f"verdict: {verdict}")
