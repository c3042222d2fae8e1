"""RACE: official directory layout, upstream input construction, per-subset accuracy."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from finetune.builtin import builtin_task_dir
from finetune.race import build_race_features, qa_text, race_accuracy, read_race
from finetune.tokenization import PairEncoder, clean_text
from pretrain.utils.errors import UserError
from tests.finetune_wordpiece import tiny_wordpiece

ARTICLE = "Tom likes apples.\nHe eats  one apple every day . Lucy likes pears."
DOC: dict[str, Any] = {
    "answers": ["B", "D"],
    "options": [["pears", "apples", "plums", "figs"], ["Tom", "Sam", "Ann", "Lucy"]],
    "questions": ["Tom likes _ .", "Who likes pears?"],
    "article": ARTICLE,
    "id": "high1.txt",
}


def _race_dir(tmp_path: Path, doc: dict | None = None) -> Path:
    root = tmp_path / "RACE"
    for split in ("train", "dev", "test"):
        for subset in ("high", "middle"):
            d = root / split / subset
            d.mkdir(parents=True)
            (d / "1.txt").write_text(json.dumps(doc or DOC))
    return root


def test_read_official_layout(tmp_path: Path) -> None:
    root = _race_dir(tmp_path)
    dev = read_race(root, "dev")
    assert [(e.subset, e.uid, e.label) for e in dev] == [
        ("middle", "middle/1/0", 1),
        ("middle", "middle/1/1", 3),
        ("high", "high/1/0", 1),
        ("high", "high/1/1", 3),
    ]
    assert dev[0].options == ("pears", "apples", "plums", "figs") and dev[0].article == ARTICLE
    assert len(read_race(root, "train", subsets=("high",))) == 2
    with pytest.raises(UserError, match="RACE split 'valid'"):
        read_race(root, "valid")
    with pytest.raises(UserError, match=r"missing RACE directory .*test/middle"):
        read_race(tmp_path / "elsewhere", "test")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"answers": ["B", "E"]}, r"answers\[1\] is 'E'"),
        ({"options": [["a", "b", "c", "d"], ["a", "b", "c"]]}, r"options\[1\] must be a list of 4"),
        ({"answers": ["B"]}, "2 questions but 2 option lists and 1 answers"),
        ({"article": None}, "field 'article' missing"),
    ],
)
def test_bad_files_name_the_file(tmp_path: Path, change: dict, message: str) -> None:
    root = _race_dir(tmp_path, {**DOC, **change})
    with pytest.raises(UserError, match=message) as info:
        read_race(root, "train")
    assert "train/middle/1.txt" in str(info.value)


def test_qa_text_substitutes_blank_or_appends() -> None:
    assert qa_text("Tom likes _ .", "apples") == "Tom likes apples ."
    assert qa_text("Who likes pears?", "Lucy") == "Who likes pears? Lucy"


def test_four_encodings_qa_first_article_second(tmp_path: Path) -> None:
    tok = tiny_wordpiece([ARTICLE, *DOC["questions"], *sum(DOC["options"], [])], vocab_size=200)
    enc = PairEncoder(tok, 16)
    ex = read_race(_race_dir(tmp_path), "test")[0]
    (feat,) = build_race_features([ex], enc)
    assert feat.label == 1 and len(feat.choices) == 4
    article = enc.tokenize(clean_text(ARTICLE))
    for option, choice in zip(ex.options, feat.choices, strict=True):
        qa = enc.tokenize(f"Tom likes {option} .")
        room = 16 - 3 - len(qa)
        assert len(article) > room  # the article is cut at its end, the question+option kept whole
        assert choice.input_ids == [enc.cls_id, *qa, enc.sep_id, *article[:room], enc.sep_id]
        assert choice.token_type_ids == [0] * (len(qa) + 2) + [1] * (room + 1)
        assert choice.attention_mask == [1] * 16
    (short_qa,) = build_race_features([ex], enc, max_qa_length=2)
    assert all(c.len_a == 2 for c in short_qa.choices)


def test_race_accuracy_per_subset() -> None:
    subsets = ["middle", "middle", "high", "high", "high"]
    out = race_accuracy(subsets, [0, 1, 2, 3, 0], [0, 0, 2, 3, 1])
    assert out == pytest.approx({"accuracy_middle": 50.0, "accuracy_high": 200 / 3, "accuracy": 60.0})
    with pytest.raises(UserError, match="5 subsets, 1 predictions"):
        race_accuracy(subsets, [0], [0])


def test_builtin_race_tiny() -> None:
    root = builtin_task_dir("race_tiny")
    for split in ("train", "dev", "test"):
        examples = read_race(root, split)
        assert len(examples) == 12 and {e.subset for e in examples} == {"middle", "high"}
        for e in examples:  # the right option is stated in the article
            assert e.options[e.label] in e.article
