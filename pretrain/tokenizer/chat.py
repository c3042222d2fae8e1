"""Chat prompts for generation and evaluation: messages rendered with a chat template as text.

The rendering is transformers' ``apply_chat_template(messages, tokenize=False,
add_generation_prompt=...)`` on the checkpoint's own Hugging Face tokenizer (or with a template
given as text), so a prompt reads exactly as the SFT data was rendered for training. The text
keeps the template's special tokens literally; :meth:`HuggingFaceTokenizer.tokenize` turns them
back into their ids (the library's behaviour), so no BOS or other token is added twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pretrain.tokenizer.base import Tokenizer
from pretrain.tokenizer.hf import HuggingFaceTokenizer
from pretrain.utils.errors import UserError

Message = dict[str, str]


def read_template_file(path: str | Path, *, flag: str = "--chat-template") -> str:
    """A Jinja chat template file's text; one line naming ``flag`` and the file when it cannot be used."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{flag}: file not found: {p}")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{flag} {p}: cannot read ({exc})") from None
    if not text.strip():
        raise UserError(f"{flag} {p}: the file is empty")
    return text


def _hf(tok: Tokenizer, source: str) -> Any:
    if not isinstance(tok, HuggingFaceTokenizer):
        raise UserError(
            f"{source}: chat templates need a Hugging Face tokenizer directory, not {tok.tokenizer_type}"
        )
    return tok.hf_tokenizer


def chat_template_of(tok: Tokenizer, template: str | None = None, *, source: str = "the tokenizer") -> str:
    """``template`` if given, else the tokenizer's own chat template (its ``default`` of several)."""
    hf = _hf(tok, source)
    if template is not None:
        return template
    found: Any = getattr(hf, "chat_template", None)
    if isinstance(found, dict):
        found = found.get("default")
    if not isinstance(found, str) or not found.strip():
        raise UserError(f"{source}: the tokenizer has no chat template (give one with --chat-template FILE)")
    return found


def render_chat(
    tok: Tokenizer,
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool = True,
    template: str | None = None,
    source: str = "the tokenizer",
) -> str:
    """``messages`` as the prompt text: with ``add_generation_prompt`` the assistant's turn is opened
    (transformers' ``add_generation_prompt=True``), else the last message is left open to be
    continued (``continue_final_message``), as lm-evaluation-harness asks for a prefilled answer."""
    hf = _hf(tok, source)
    text = chat_template_of(tok, template, source=source)
    try:
        out = hf.apply_chat_template(
            [dict(m) for m in messages], chat_template=text, tokenize=False,
            add_generation_prompt=add_generation_prompt, continue_final_message=not add_generation_prompt,
        )  # fmt: skip
    except Exception as exc:  # jinja2 TemplateError, ValueError from transformers
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"{source}: cannot render the chat template ({first})") from None
    return str(out)
