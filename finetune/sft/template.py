"""The chat template conversations are rendered with: the tokenizer's own or ``--chat-template FILE``.

The template text is hashed (``template_sha256`` in the result) so that results say which
rendering produced their tokens and masks. Whether it carries ``{% generation %}`` markers decides
how the assistant mask is found (:mod:`finetune.sft.masks`).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pretrain.tokenizer.chat import read_template_file
from pretrain.utils.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass(frozen=True, kw_only=True)
class ChatTemplate:
    """A Jinja chat template and where it came from (``--chat-template FILE`` or the tokenizer)."""

    text: str
    source: str
    from_file: bool = False  # --chat-template FILE (saved with a --save'd tokenizer)

    @property
    def has_generation_markers(self) -> bool:
        return _GENERATION.search(self.text) is not None

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


def chat_template(
    hf_tokenizer: PreTrainedTokenizerBase, template_file: str | Path | None, *, tokenizer_source: str
) -> ChatTemplate:
    """``--chat-template FILE``'s text, else the tokenizer's; :class:`UserError` when there is none."""
    if template_file is not None:
        return ChatTemplate(text=read_template_file(template_file), source=str(template_file), from_file=True)
    found: Any = getattr(hf_tokenizer, "chat_template", None)
    if isinstance(found, dict):  # several named templates: the default one
        found = found.get("default")
    if not isinstance(found, str) or not found.strip():
        raise UserError(
            f"{tokenizer_source}: the tokenizer has no chat template; chat data needs one (--chat-template FILE)"
        )
    return ChatTemplate(text=found, source=tokenizer_source)
