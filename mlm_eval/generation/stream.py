"""What ``mlm-generate`` prints while it generates: stop-string cutting and the streaming text
writer, shared by the ``--ckpt`` (:mod:`mlm_eval.generation.cli`) and ``--hf-model``
(:mod:`mlm_eval.generation.hf`) paths so both print the same way."""

from __future__ import annotations

import sys
from collections.abc import Callable


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """``text`` before the earliest stop string, and whether one occurred."""
    hits = [text.index(s) for s in stops if s and s in text]
    return (text[: min(hits)], True) if hits else (text, False)


class TextStream:
    """Prints a prompt, then its continuation as it grows (whole characters only, cut at stop
    strings, special tokens left out by ``decode``), then a newline: both ``--ckpt`` and
    ``--hf-model`` print through it."""

    def __init__(self, decode: Callable[[list[int]], str], stops: list[str], *, show: bool) -> None:
        self.decode, self.stops, self.show = decode, stops, show
        self.ids: list[int] = []
        self.printed = 0

    def start(self, prompt: str) -> None:
        if self.show:
            sys.stdout.write(prompt)
            sys.stdout.flush()

    def add(self, _row: int, token: int) -> None:
        self.ids.append(token)
        text, _ = cut_at_stop(self.decode(self.ids), self.stops)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for its other bytes
            return
        if self.show and len(text) > self.printed:
            sys.stdout.write(text[self.printed :])
            sys.stdout.flush()
        self.printed = max(self.printed, len(text))

    def finish(self) -> None:
        if self.show:
            sys.stdout.write("\n")
            sys.stdout.flush()
