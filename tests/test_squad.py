"""SQuAD: reading, windowed features, post-processing and the official metrics (hand-computed)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from finetune.builtin import builtin_task_dir
from finetune.squad import (
    SquadExample,
    SquadFeature,
    SquadFeatureConfig,
    build_squad_features,
    read_squad_hf,
    read_squad_json,
)
from finetune.squad_metrics import GoldQuestion, compute_exact, compute_f1, normalize_answer, squad_evaluate
from finetune.squad_postprocess import (
    SquadPostprocessConfig,
    postprocess_squad,
    write_null_odds,
    write_squad_predictions,
)
from finetune.tokenization import PairEncoder
from pretrain.utils.errors import UserError
from tests.finetune_wordpiece import tiny_wordpiece

# ---------------------------------------------------------------- official metrics


def test_normalize_and_token_f1_hand_computed() -> None:
    assert normalize_answer("The  Quick, brown fox!") == "quick brown fox"
    assert normalize_answer("an apple a day") == "apple day"
    assert normalize_answer("Theatre of Anatomy") == "theatre of anatomy"  # articles only as whole words
    assert compute_exact("The Denver Broncos", "denver broncos.") == 1
    # gold [cat, sat, on, mat], pred [cat, on, mat]: P 1, R 3/4
    assert compute_f1("the cat sat on the mat", "cat on a mat") == pytest.approx(2 * 0.75 / 1.75)
    assert compute_f1("", "") == 1.0 and compute_f1("", "x") == 0.0 and compute_f1("a b", "c") == 0.0


GOLDS = [
    GoldQuestion(qid="q1", answers=("Denver Broncos", "The Denver Broncos")),
    GoldQuestion(qid="q2", answers=("Carolina Panthers",)),
    GoldQuestion(qid="q3", answers=("Santa Clara, California",)),
]
PREDS = {"q1": "denver broncos", "q2": "Panthers", "q3": "Levi's Stadium in Santa Clara"}
# F1: q1 1, q2 P 1 R 1/2 -> 2/3, q3 common {santa, clara} P 2/5 R 2/3 -> 1/2


def test_squad1_exact_and_f1() -> None:
    out = squad_evaluate(GOLDS, PREDS)
    assert out == pytest.approx({"exact_match": 100 / 3, "f1": 100 * (1 + 2 / 3 + 1 / 2) / 3, "total": 3})
    missing = squad_evaluate(GOLDS, {"q1": "Denver Broncos"})
    assert missing["exact_match"] == pytest.approx(100 / 3)  # missing predictions score 0


def test_squad2_no_answer_breakdown_and_threshold_search() -> None:
    golds = [*GOLDS, GoldQuestion(qid="q4", answers=()), GoldQuestion(qid="q5", answers=())]
    preds = {**PREDS, "q4": "", "q5": "something"}
    out = squad_evaluate(golds, preds)
    assert out["exact_match"] == pytest.approx(100 * 2 / 5)
    assert out["f1"] == pytest.approx(100 * (1 + 2 / 3 + 1 / 2 + 1 + 0) / 5)
    assert out["HasAns_exact"] == pytest.approx(100 / 3) and out["HasAns_total"] == 3
    assert out["NoAns_exact"] == pytest.approx(50.0) and out["NoAns_f1"] == pytest.approx(50.0)
    assert out["NoAns_total"] == 2
    na = {"q1": 0.1, "q2": 0.6, "q3": 0.3, "q4": 0.9, "q5": 0.2}
    out = squad_evaluate(golds, preds, na_probs=na)
    # Sweep from "all empty" (2 right): q1 +1 -> 3 @.1, q5 -1, q3 +.5, q2 +2/3 -> 3.1667 @.6, q4 +0.
    assert out["best_f1"] == pytest.approx(100 * (3 + 1 / 6) / 5) and out["best_f1_thresh"] == 0.6
    assert out["best_exact"] == pytest.approx(60.0) and out["best_exact_thresh"] == 0.1
    # With a threshold of .5, q2 (.6) and q4 (.9) count as predicted empty: q2 -> 0, q4 -> 1.
    out = squad_evaluate(golds, preds, na_probs=na, na_prob_thresh=0.5)
    assert out["f1"] == pytest.approx(100 * (1 + 0 + 1 / 2 + 1 + 0) / 5)


# ---------------------------------------------------------------- reading


def _squad_file(tmp_path: Path, qas: list[dict], context: str = "Denver Broncos won in Santa Clara.") -> Path:
    doc = {"version": "v2.0", "data": [{"title": "SB50", "paragraphs": [{"context": context, "qas": qas}]}]}
    path = tmp_path / "dev.json"
    path.write_text(json.dumps(doc))
    return path


def test_read_official_json_and_errors(tmp_path: Path) -> None:
    path = _squad_file(
        tmp_path,
        [
            {"id": "a", "question": "Who won?", "answers": [{"text": "Denver Broncos", "answer_start": 0}]},
            {
                "id": "b",
                "question": "Who lost?",
                "answers": [],
                "is_impossible": True,
                "plausible_answers": [{"text": "Denver", "answer_start": 0}],
            },
        ],
    )
    a, b = read_squad_json(path)
    assert (a.qid, a.title, a.answers[0].text, a.answers[0].start, a.is_impossible) == (
        "a",
        "SB50",
        "Denver Broncos",
        0,
        False,
    )
    assert b.is_impossible and b.answers == () and b.gold().answers == ()
    bad = _squad_file(
        tmp_path, [{"id": "a", "question": "Q?", "answers": [{"text": "x", "answer_start": 99}]}]
    )
    with pytest.raises(
        UserError, match=r"paragraphs\[0\]\.qas\[0\]\.answers\[0\]\.answer_start: 99 is outside"
    ):
        read_squad_json(bad)
    bad = _squad_file(tmp_path, [{"id": "a", "answers": []}])
    with pytest.raises(UserError, match=r"qas\[0\]: answerable question without answers"):
        read_squad_json(bad)
    bad = _squad_file(tmp_path, [{"id": "a", "answers": [], "is_impossible": True}])
    with pytest.raises(UserError, match=r"qas\[0\]: missing field 'question'"):
        read_squad_json(bad)
    (tmp_path / "broken.json").write_text("{\n  oops")
    with pytest.raises(UserError, match=r"broken.json:2: not valid JSON"):
        read_squad_json(tmp_path / "broken.json")


def test_read_hf_squad_v2() -> None:
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict(
        {
            "id": ["a", "b"],
            "title": ["t", "t"],
            "context": ["Paris is big.", "Paris is big."],
            "question": ["What is big?", "What is small?"],
            "answers": [{"text": ["Paris"], "answer_start": [0]}, {"text": [], "answer_start": []}],
        }
    )
    a, b = read_squad_hf(ds)
    assert a.answers[0].text == "Paris" and not a.is_impossible and b.is_impossible


# ---------------------------------------------------------------- features and windows

CONTEXT = " ".join(f"w{i}" for i in range(40))


@pytest.fixture(scope="module")
def word_encoder_factory():  # type: ignore[no-untyped-def]
    tok = tiny_wordpiece([CONTEXT, "where is it ?"] * 3, vocab_size=2000)  # every word is one token
    return lambda n: PairEncoder(tok, n)


def test_windows_stride_offsets_and_edge_answer(word_encoder_factory) -> None:  # type: ignore[no-untyped-def]
    answer = "w8 w9 w10"  # tokens 8..10
    ex = SquadExample(
        qid="q",
        title="",
        question="where is it ?",
        context=CONTEXT,
        answers=(_answer(CONTEXT, answer),),
        is_impossible=False,
    )
    enc = word_encoder_factory(4 + 3 + 10)  # 4 question tokens: windows of 10 context tokens
    assert len(enc.tokenize(CONTEXT)) == 40 and len(enc.tokenize(ex.question)) == 4
    feats = build_squad_features(
        [ex], enc, SquadFeatureConfig(max_seq_length=17, doc_stride=4), is_training=False
    )
    starts = [0, 4, 8, 12, 16, 20, 24, 28, 32]  # the last window (8 tokens) ends the context
    assert len(feats) == len(starts)
    b0 = 4 + 2
    for f, s in zip(feats, starts, strict=True):
        ctx = [CONTEXT[o[0] : o[1]] for o in f.offsets if o is not None]
        assert ctx == [f"w{i}" for i in range(s, min(s + 10, 40))]
        assert f.offsets[:b0] == [None] * b0 and f.token_type_ids[b0] == 1 and f.token_type_ids[b0 - 1] == 0
    # Window 0 holds w0..w9: the answer crosses its end, so it points at [CLS].
    assert (feats[0].start_position, feats[0].end_position) == (0, 0)
    assert (feats[1].start_position, feats[1].end_position) == (b0 + 4, b0 + 6)
    assert (feats[2].start_position, feats[2].end_position) == (b0 + 0, b0 + 2)
    assert (feats[3].start_position, feats[3].end_position) == (0, 0)
    assert [(f.context_start, f.doc_offset, f.doc_length) for f in feats[-2:]] == [(b0, 28, 10), (b0, 32, 8)]
    # One-hot logits at the gold positions of every window holding the answer recover it exactly.
    starts_l, ends_l = _one_hot_logits(feats, 17)
    preds = postprocess_squad([ex], feats, starts_l, ends_l, SquadPostprocessConfig())
    assert preds.predictions == {"q": answer}


def _answer(context: str, text: str):  # type: ignore[no-untyped-def]
    from finetune.squad import SquadAnswer

    return SquadAnswer(text=text, start=context.index(text))


def _one_hot_logits(feats: list[SquadFeature], seq: int) -> tuple[np.ndarray, np.ndarray]:
    s, e = np.zeros((len(feats), seq)), np.zeros((len(feats), seq))
    for i, f in enumerate(feats):
        s[i, f.start_position] = e[i, f.end_position] = 10.0
    return s, e


@pytest.mark.parametrize("name", ["squad_tiny", "squad2_tiny"])
def test_gold_spans_round_trip_through_windows(name: str) -> None:
    examples = read_squad_json(builtin_task_dir(name) / "dev.json")
    tok = tiny_wordpiece([e.context + " " + e.question for e in examples], vocab_size=150)
    enc = PairEncoder(tok, 64)  # small windows: every context is split into several
    feats = build_squad_features(
        examples, enc, SquadFeatureConfig(max_seq_length=64, doc_stride=8), is_training=True
    )
    assert len(feats) > 1.5 * len(examples)
    answerable = {x.qid for x in examples if not x.is_impossible}
    assert {f.qid for f in feats if f.start_position > 0} == answerable  # each answer fits some window
    assert any(f.start_position == 0 for f in feats if f.qid in answerable)  # and is cut by others
    v2 = name == "squad2_tiny"
    assert any(e.is_impossible for e in examples) == v2
    s, e = _one_hot_logits(feats, 64)
    out = postprocess_squad(examples, feats, s, e, SquadPostprocessConfig(version_2_with_negative=v2))
    for ex in examples:
        assert out.predictions[ex.qid] == ("" if ex.is_impossible else ex.answers[0].text), ex.qid
    metrics = squad_evaluate([x.gold() for x in examples], out.predictions)
    assert metrics["exact_match"] == 100.0 and metrics["f1"] == 100.0
    if v2:
        assert metrics["HasAns_exact"] == 100.0 and metrics["NoAns_exact"] == 100.0
        assert all((v < 0) == (q in answerable) for q, v in out.null_odds.items())


# ---------------------------------------------------------------- post-processing rules

POST_CONTEXT = "Alpha beta gamma, delta"


WORD_OFFSETS = [(0, 5), (6, 10), (11, 16), (16, 17), (18, 23)]  # alpha beta gamma , delta


def _feature(first: int = 0, count: int = 5, window: int = 0) -> SquadFeature:
    # [CLS] q q [SEP] <count context tokens from token first> [SEP] [PAD]...
    offsets = [None] * 4 + WORD_OFFSETS[first : first + count] + [None] * (7 - count)
    return SquadFeature(
        example_index=0,
        qid="x",
        window_index=window,
        input_ids=[0] * 11,
        token_type_ids=[0] * 11,
        attention_mask=[1] * 10 + [0],
        offsets=offsets,
        context_start=4,
        doc_offset=first,
        doc_length=count,
        start_position=0,
        end_position=0,
    )


EX = SquadExample(qid="x", title="", question="q q", context=POST_CONTEXT, answers=(), is_impossible=True)
START = [2.0, 9, 0, 0, 1, 8, 0, 0, 0, 0, 0]  # best start in the question: dropped
END = [1.0, 0, 0, 0, 9, 3, 7, 0, 0, 20, 30]  # best ends on [SEP]/[PAD] and before beta: dropped


def test_invalid_spans_are_dropped_and_text_comes_from_the_context() -> None:
    out = postprocess_squad([EX], [_feature()], [START], [END], SquadPostprocessConfig())
    assert out.predictions == {"x": "beta gamma"}  # 8 + 7 beats alpha/alpha 1 + 9 and beta/beta 8 + 3
    assert [n.text for n in out.nbest["x"]][:3] == ["beta gamma", "beta", "Alpha"]
    assert sum(n.probability for n in out.nbest["x"]) == pytest.approx(1.0)
    short = postprocess_squad([EX], [_feature()], [START], [END], SquadPostprocessConfig(max_answer_length=1))
    assert short.predictions == {"x": "beta"}
    end = list(END)
    end[7] = 8.0  # "gamma," ends on the comma token: the text keeps the original punctuation
    assert (
        postprocess_squad([EX], [_feature()], [START], [end], SquadPostprocessConfig()).predictions["x"]
        == "beta gamma,"
    )


def test_a_span_is_scored_only_in_the_window_that_centres_it() -> None:
    # Window A holds alpha beta gamma ","; window B holds beta gamma "," delta.
    # "beta": A min(1, 2) = 1 beats B min(0, 3) = 0, so B's very confident "beta" is ignored;
    # "delta" exists only in B, "alpha" only in A.
    a, b = _feature(0, 4, 0), _feature(1, 4, 1)
    start = [[0, 0, 0, 0, 10, 5, 0, 0, 0, 0, 0], [0, 0, 0, 0, 30, 0, 0, 1, 0, 0, 0]]
    end = [[0, 0, 0, 0, 10, 5, 0, 0, 0, 0, 0], [0, 0, 0, 0, 30, 0, 0, 1, 0, 0, 0]]
    one_token = SquadPostprocessConfig(max_answer_length=1)
    out = postprocess_squad([EX], [a, b], start, end, one_token)
    assert out.predictions == {"x": "Alpha"}
    texts = [n.text for n in out.nbest["x"]]
    assert "delta" in texts and texts.index("Alpha") < texts.index("beta")
    # With B alone "beta" is its best span.
    b_only = postprocess_squad([EX], [b], start[1:], end[1:], one_token)
    assert b_only.predictions == {"x": "beta"}


def test_null_score_threshold_and_files(tmp_path: Path) -> None:
    start, end = list(START), list(END)
    start[0], end[0] = 9.0, 7.0  # null 16 vs best span 15: null - best = 1
    cfg = SquadPostprocessConfig(version_2_with_negative=True)
    out = postprocess_squad([EX], [_feature()], [start], [end], cfg)
    assert out.predictions == {"x": ""} and out.null_odds == {"x": pytest.approx(1.0)}
    assert "" in [n.text for n in out.nbest["x"]]
    lenient = SquadPostprocessConfig(version_2_with_negative=True, null_score_diff_threshold=1.5)
    assert postprocess_squad([EX], [_feature()], [start], [end], lenient).predictions == {"x": "beta gamma"}
    write_squad_predictions(tmp_path / "predictions.json", out.predictions)
    write_null_odds(tmp_path / "null_odds.json", out.null_odds)
    assert json.loads((tmp_path / "predictions.json").read_text()) == {"x": ""}
    assert json.loads((tmp_path / "null_odds.json").read_text()) == {"x": pytest.approx(1.0)}
    with pytest.raises(UserError, match="do not match 2 features"):
        postprocess_squad([EX], [_feature(), _feature()], [start], [end], cfg)
