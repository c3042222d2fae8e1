"""Reading user text files: a byte that is not UTF-8 is one line naming the file, line and byte."""

from __future__ import annotations

import os

from pretrain.utils.errors import UserError


def read_utf8(path: str | os.PathLike[str], *, what: str = "") -> str:
    """The file's text; a decoding error raises :class:`UserError` with line and byte offset."""
    data = open(path, "rb").read()  # noqa: SIM115 (read at once, closed by refcount)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        prefix = f"{what} " if what else ""
        raise UserError(
            f"{prefix}{os.fspath(path)}: line {line}: byte 0x{data[exc.start]:02x} at offset {exc.start} is not "
            "UTF-8 (convert the file to UTF-8)"
        ) from None
