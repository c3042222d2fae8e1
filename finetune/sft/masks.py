"""A conversation -> token ids and the assistant loss mask, exactly as transformers marks it.

* A template with ``{% generation %}`` markers: ``apply_chat_template(..., return_dict=True,
  return_assistant_tokens_mask=True)`` itself (every token overlapping a marked span is 1).
* A template without: the assistant spans are found by rendering each conversation prefix --
  the messages before assistant turn k with the generation prompt, and through turn k -- and
  taking the text between them (as Megatron-Bridge does); tokens overlapping a span get 1, the
  same rule transformers applies to marked spans. Every rendered prefix must be a prefix of the
  whole rendering; a template that renders earlier turns differently once later ones exist
  (prefixes that do not nest) is refused with one line: no mask is guessed, and the loss never
  falls back to every token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from finetune.sft.records import Message
from finetune.sft.template import ChatTemplate
from pretrain.utils.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Encoded = tuple[list[int], list[int]]  # token ids, loss mask (1 = assistant token)
Span = tuple[int, int]  # [start, end) characters of the rendered text


class ChatRenderer:
    """Renders conversations with one template and tokenizer (a fast transformers tokenizer)."""

    def __init__(self, hf_tokenizer: PreTrainedTokenizerBase, template: ChatTemplate) -> None:
        if not getattr(hf_tokenizer, "is_fast", False):
            raise UserError(
                f"{template.source}: the assistant mask needs a fast (Rust) Hugging Face tokenizer"
            )
        self.tok, self.template = hf_tokenizer, template

    def _render(self, messages: Sequence[Message], where: str, *, generation_prompt: bool = False) -> str:
        try:
            text = self.tok.apply_chat_template([{"role": m.role, "content": m.content} for m in messages],
                                                chat_template=self.template.text, tokenize=False,
                                                add_generation_prompt=generation_prompt)  # fmt: skip
        except Exception as exc:  # jinja2 errors: the template's own raise_exception, syntax, ...
            raise UserError(f"{where}: the chat template ({self.template.source}) fails: {exc}") from None
        return str(text)

    def encode(self, messages: Sequence[Message], where: str) -> Encoded:
        """Token ids ``[n]`` of the rendered conversation and its assistant mask ``[n]``."""
        if self.template.has_generation_markers:
            return self._marked(messages, where)
        return self._prefix_diffed(messages, where)

    def _marked(self, messages: Sequence[Message], where: str) -> Encoded:
        try:
            out: Any = self.tok.apply_chat_template([{"role": m.role, "content": m.content} for m in messages],
                                               chat_template=self.template.text, tokenize=True, return_dict=True,
                                               return_assistant_tokens_mask=True)  # fmt: skip
        except Exception as exc:
            raise UserError(f"{where}: the chat template ({self.template.source}) fails: {exc}") from None
        return [int(i) for i in out["input_ids"]], [int(m) for m in out["assistant_masks"]]

    def assistant_spans(self, messages: Sequence[Message], where: str) -> tuple[str, list[Span]]:
        """The whole rendering and each assistant turn's character span, by prefix diffing."""
        full = self._render(messages, where)
        spans = []
        for k, m in enumerate(messages):
            if m.role != "assistant":
                continue
            before = self._render(messages[:k], where, generation_prompt=True) if k else ""
            through = self._render(messages[: k + 1], where)
            if not (full.startswith(before) and full.startswith(through) and len(through) >= len(before)):
                raise UserError(
                    f"{where}: the chat template ({self.template.source}) renders conversation prefixes that do "
                    f"not nest (at message {k}); the assistant mask needs {{% generation %}} markers in it"
                )
            if len(through) > len(before):
                spans.append((len(before), len(through)))
        return full, spans

    def _prefix_diffed(self, messages: Sequence[Message], where: str) -> Encoded:
        text, spans = self.assistant_spans(messages, where)
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        return [int(i) for i in enc["input_ids"]], overlap_mask(enc["offset_mapping"], spans)


def overlap_mask(offsets: Sequence[tuple[int, int]], spans: Sequence[Span]) -> list[int]:
    """1 for each token ``[start, end)`` that overlaps a span (both in text order), else 0."""
    mask = [0] * len(offsets)
    k = 0
    for i, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if end > spans[k][0]:
            mask[i] = 1
    return mask
