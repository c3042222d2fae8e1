"""SFT data: records with FILE:LINE errors, assistant masks (generation markers = prefix diffing,
non-nesting templates refused), no-loss conversations skipped and named, truncation counted,
packing that keeps every boundary token, restarts positions and never attends across samples."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from finetune.sft.masks import ChatRenderer
from finetune.sft.packing import block_causal_mask, pack_rows, pad_rows
from finetune.sft.records import Message, read_records
from finetune.sft.samples import Sample, encode_records
from finetune.sft.template import ChatTemplate
from finetune.sft.tiny_tokenizer import CHAT_TEMPLATE_FILE, SFT_CHAT_FILE, write_tiny_chat_tokenizer
from pretrain.utils.errors import UserError

MARKED = CHAT_TEMPLATE_FILE.read_text()
UNMARKED = MARKED.replace("{%- generation -%}", "").replace("{%- endgeneration -%}", "")
# renders every earlier assistant turn without its end token once a later turn exists: prefixes do not nest
NON_NESTING = UNMARKED.replace("message['content'] + '<|im_end|>\\n'",
                               "message['content'] + ('<|im_end|>\\n' if loop.last else '\\n')", 1)  # fmt: skip


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(write_tiny_chat_tokenizer(tmp_path_factory.mktemp("chat_tok")))


def _conversations() -> list[tuple[Message, ...]]:
    return [r.messages for r in read_records(SFT_CHAT_FILE, flag="--data")]


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_templates_fixtures_are_what_they_claim() -> None:
    assert ChatTemplate(text=MARKED, source="m").has_generation_markers
    assert not ChatTemplate(text=UNMARKED, source="u").has_generation_markers
    assert NON_NESTING != UNMARKED


def test_marker_mask_is_transformers_and_prefix_diffing_equals_it(hf_tok: Any) -> None:
    marked = ChatRenderer(hf_tok, ChatTemplate(text=MARKED, source="m"))
    diffed = ChatRenderer(hf_tok, ChatTemplate(text=UNMARKED, source="u"))
    for msgs in _conversations():
        as_dicts = [{"role": m.role, "content": m.content} for m in msgs]
        theirs = hf_tok.apply_chat_template(as_dicts, chat_template=MARKED, return_dict=True,
                                            return_assistant_tokens_mask=True)  # fmt: skip
        ids, mask = marked.encode(msgs, "f:1")
        assert (ids, mask) == (list(theirs["input_ids"]), list(theirs["assistant_masks"]))
        assert diffed.encode(msgs, "f:1") == (ids, mask)
        assert 0 < sum(mask) < len(mask)  # user and system turns carry no loss


def test_non_nesting_template_is_refused_with_one_line(hf_tok: Any) -> None:
    renderer = ChatRenderer(hf_tok, ChatTemplate(text=NON_NESTING, source="t.jinja"))
    multi = next(m for m in _conversations() if sum(x.role == "assistant" for x in m) > 1)
    with pytest.raises(UserError, match=r"^data.jsonl:7: the chat template \(t.jinja\) renders conversation "
                       r"prefixes that do not nest \(at message 1\)"):  # fmt: skip
        renderer.encode(multi, "data.jsonl:7")


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("{not json", "not valid JSON"),
        ('["a"]', "expected a JSON object, got list"),
        ('{"messages": []}', "field 'messages' must be a non-empty list"),
        ('{"messages": [{"role": "user"}]}', "messages[0] needs string fields 'role' and 'content'"),
        ('{"prompt": "a"}', "field 'completion' missing or not a string"),
        ('{"text": "a"}', "expected a 'messages' list or 'prompt' and 'completion' strings"),
        ('{"prompt": "a", "completion": "b"}', "a completion record in a file of chat records"),
    ],
)
def test_malformed_lines_name_file_and_line(tmp_path: Path, line: str, reason: str) -> None:
    path = _write(tmp_path / "d.jsonl", [SFT_CHAT_FILE.read_text().splitlines()[0], "", line])
    with pytest.raises(UserError) as exc:
        read_records(path, flag="--data")
    assert str(exc.value).startswith(f"{path}:3: ") and reason in str(exc.value)


class _Tok:  # the Tokenizer surface prompt/completion encoding uses
    bos, eod, adds_bos = 1, 2, True

    def tokenize(self, text: str) -> list[int]:
        return [10 + len(w) for w in text.split()]


def test_no_loss_conversations_are_skipped_and_named_truncation_counted(tmp_path: Path, hf_tok: Any) -> None:
    lines = SFT_CHAT_FILE.read_text().splitlines()[:3]
    lines.insert(1, json.dumps({"messages": [{"role": "user", "content": "hello there"}]}))
    path = _write(tmp_path / "d.jsonl", lines)
    renderer = ChatRenderer(hf_tok, ChatTemplate(text=MARKED, source="m"))
    records = read_records(path, flag="--data")
    full = encode_records(records, tokenizer=_Tok(), renderer=renderer, loss_on="assistant", seq_length=512,  # type: ignore[arg-type]
                          flag="--data")  # fmt: skip
    assert full.skipped == (f"{path}:2",) and full.truncated == 0 and len(full.samples) == 3
    # every sample cut before its answer: truncated, then skipped (no loss token left) -- never all-ones
    with pytest.raises(UserError, match="no record has a loss token"):
        encode_records(
            records, tokenizer=_Tok(), renderer=renderer, loss_on="assistant", seq_length=4, flag="--data"
        )  # type: ignore[arg-type]
    cut = encode_records(
        records, tokenizer=_Tok(), renderer=renderer, loss_on="all", seq_length=8, flag="--data"
    )  # type: ignore[arg-type]
    assert cut.truncated == 4 and all(len(s.ids) == 9 for s in cut.samples)


def test_prompt_completion_masks_the_completion_and_eos(tmp_path: Path) -> None:
    path = _write(tmp_path / "pc.jsonl", [json.dumps({"prompt": "a bb", "completion": "ccc"})])
    records = read_records(path, flag="--data")
    (s,) = encode_records(records, tokenizer=_Tok(), renderer=None, loss_on="completion", seq_length=16,  # type: ignore[arg-type]
                          flag="--data").samples  # fmt: skip
    assert s.ids.tolist() == [1, 11, 12, 13, 2] and s.loss.tolist() == [0, 0, 0, 1, 1]
    with pytest.raises(UserError, match="--loss-on assistant needs chat"):
        encode_records(
            records, tokenizer=_Tok(), renderer=None, loss_on="assistant", seq_length=16, flag="--data"
        )  # type: ignore[arg-type]


def _samples(lengths: list[int], seed: int = 0) -> list[Sample]:
    rng = np.random.default_rng(seed)
    return [Sample(ids=rng.integers(3, 300, n), loss=rng.random(n) < 0.6) for n in lengths]


def test_packing_keeps_every_token_and_restarts_positions() -> None:
    samples = _samples([5, 7, 3, 9, 4])
    packed = pack_rows(samples, 12, pad_id=0)
    padded = pad_rows(samples, 12, pad_id=0)
    assert packed["tokens"].shape == (2, 12)  # predictions 4+6+2 = 12 | 8+3 = 11 (+1 padding)
    # the same (input, label, loss) triples, boundary ids included, in the same order
    for key in ("tokens", "labels", "loss_mask"):
        keep_packed = packed["segments"] >= 0
        keep_padded = torch.arange(12)[None] < torch.tensor([len(s.ids) - 1 for s in samples])[:, None]
        assert torch.equal(packed[key][keep_packed], padded[key][keep_padded])
    assert packed["position_ids"][0].tolist()[:10] == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5]
    mask = block_causal_mask(packed["segments"])[0, 0]
    assert mask[5, 4] and mask[4, 4] and not mask[4, 5]  # within sample 2: causal
    assert not mask[4, 3] and not mask[5, 0]  # across the boundary: never
