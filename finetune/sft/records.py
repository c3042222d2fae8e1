"""SFT training/validation files: JSON lines of chat conversations or prompt/completion pairs.

* ``{"messages": [{"role": str, "content": str}, ...]}`` -- rendered with a chat template;
* ``{"prompt": str, "completion": str}`` -- the prompt's tokens, then the completion's and EOS.

One file holds one of the two formats. A malformed line is refused as ``FILE:LINE: reason``
(:mod:`pretrain.utils.jsonl`, as every command that reads JSON lines).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from pretrain.utils.errors import UserError
from pretrain.utils.jsonl import JsonObject, iter_json_objects, string_field

RecordFormat = Literal["chat", "completion"]


@dataclass(frozen=True, kw_only=True)
class Message:
    role: str
    content: str


@dataclass(frozen=True, kw_only=True)
class SFTRecord:
    """One line: ``messages`` (chat) or ``prompt``/``completion``; ``where`` is ``FILE:LINE``."""

    where: str
    messages: tuple[Message, ...] = ()
    prompt: str = ""
    completion: str = ""

    @property
    def format(self) -> RecordFormat:
        return "chat" if self.messages else "completion"


def _messages(record: JsonObject, where: str) -> tuple[Message, ...]:
    raw = record["messages"]
    if not isinstance(raw, list) or not raw:
        raise UserError(f"{where}: field 'messages' must be a non-empty list of {{role, content}} objects")
    out = []
    for k, m in enumerate(raw):
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
        ):
            raise UserError(f"{where}: messages[{k}] needs string fields 'role' and 'content'")
        out.append(Message(role=m["role"], content=m["content"]))
    return tuple(out)


def parse_record(record: JsonObject, *, source: str | os.PathLike[str], line: int) -> SFTRecord:
    """One JSON object as an :class:`SFTRecord`; :class:`UserError` ``source:line: ...`` otherwise."""
    where = f"{source}:{line}"
    if "messages" in record:
        if "prompt" in record or "completion" in record:
            raise UserError(
                f"{where}: has both 'messages' and 'prompt'/'completion'; use one format per line"
            )
        return SFTRecord(where=where, messages=_messages(record, where))
    if "prompt" in record or "completion" in record:
        prompt = string_field(record, "prompt", source=source, line=line)
        completion = string_field(record, "completion", source=source, line=line)
        return SFTRecord(where=where, prompt=prompt, completion=completion)
    raise UserError(f"{where}: expected a 'messages' list or 'prompt' and 'completion' strings")


def read_records(path: str | os.PathLike[str], *, flag: str) -> list[SFTRecord]:
    """Every record of ``path`` (blank lines skipped); all of one format, at least one."""
    records = [parse_record(obj, source=path, line=n) for n, obj in iter_json_objects(path, flag=flag)]
    if not records:
        raise UserError(f"{flag} {path}: no records")
    first = records[0].format
    for r in records:
        if r.format != first:
            raise UserError(
                f"{r.where}: a {r.format} record in a file of {first} records ({records[0].where})"
            )
    return records
