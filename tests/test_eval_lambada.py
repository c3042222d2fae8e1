"""LAMBADA: strict vs last-token on a rigged scorer, HF reference, padding invariance, padded vocab, CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from mlm_eval.builtin import builtin_path
from mlm_eval.cli import main
from mlm_eval.scoring.scorer import HFCausalLMScorer, ScoreOutput, nll_and_argmax
from mlm_eval.tasks.lambada import evaluate_lambada, read_lambada_jsonl, score_lambada, split_example
from pretrain.utils.errors import UserError
from tests.eval_helpers import build_tiny_hf, load_tiny, reference_logprobs

HIT, MISS = 0.25, 3.0  # the rigged scorer's NLL for a predicted / unpredicted target


class TableEncoder:
    """Rigged tokenizer: a fixed table from text to ids (unknown text is a test bug)."""

    prefix_token_id = 0

    def __init__(self, table: dict[str, list[int]]) -> None:
        self.table = table

    def encode(self, text: str) -> list[int]:
        return self.table[text]


class NextIdScorer:
    """Rigged model: after id x it predicts x + 1 (argmax); nll HIT if the target is x + 1, else MISS."""

    max_length, vocab_size = 64, 1000

    def score(self, input_ids: torch.Tensor, target_ids: torch.Tensor) -> ScoreOutput:
        hit = (target_ids == input_ids + 1) & (target_ids >= 0)
        nll = torch.where(hit, HIT, MISS).double() * (target_ids >= 0)
        return ScoreOutput(nll=nll, is_argmax=hit)


TABLE = {
    # strict splits: context (stripped) and " " + last word, tokenized separately
    "a b": [10, 11],
    " c": [12, 13],  # 11->12, 12->13: both right
    " d": [12, 20],  # first right, second wrong
    " e": [30, 31],  # first wrong, second right
    # last-token: the whole text, tokenized at once (its last id is the target)
    "a b c": [10, 11, 12, 13],
    "a b d": [10, 11, 12, 20],
    "a b e": [10, 11, 30, 31],
}
TEXTS = ["a b c", "a b d", "a b e"]


def test_strict_needs_every_target_token() -> None:
    scores = score_lambada(NextIdScorer(), TableEncoder(TABLE), TEXTS, strict=True, progress=False)
    assert [s.correct for s in scores] == [True, False, False]
    assert [s.nll for s in scores] == [2 * HIT, HIT + MISS, MISS + HIT]
    out = evaluate_lambada(NextIdScorer(), TableEncoder(TABLE), TEXTS, strict=True, progress=False)
    assert out["accuracy"] == pytest.approx(1 / 3) and out["correct"] == 1 and out["count"] == 3
    assert out["target_tokens"] == 6
    total = 4 * HIT + 2 * MISS
    assert out["ppl"] == pytest.approx(math.exp(total / 3))  # per example
    assert out["token_ppl"] == pytest.approx(math.exp(total / 6))  # per target token


def test_last_token_scores_only_the_final_subword() -> None:
    out = evaluate_lambada(NextIdScorer(), TableEncoder(TABLE), TEXTS, strict=False, progress=False)
    # targets 13 (after 12: right), 20 (after 12: wrong), 31 (after 30: right)
    assert out["correct"] == 2 and out["accuracy"] == pytest.approx(2 / 3) and out["target_tokens"] == 3
    assert out["ppl"] == pytest.approx(math.exp((2 * HIT + MISS) / 3)) == out["token_ppl"]


def test_strict_split_strips_context_and_keeps_last_word_space() -> None:
    seen: list[str] = []

    class Spy(TableEncoder):
        def encode(self, text: str) -> list[int]:
            seen.append(text)
            return [1]

    split_example(Spy({}), "  one two\tthree  \n", strict=True)
    assert seen == ["one two", " three"]


def test_long_context_is_cut_on_the_left() -> None:
    table = {"x y": list(range(100, 200)), " z": [200, 201]}
    scores = score_lambada(NextIdScorer(), TableEncoder(table), ["x y z"], progress=False)
    assert scores[0].truncated and scores[0].correct  # 199->200->201 survive the cut to 64 inputs


@pytest.fixture(scope="module")
def tiny_dir(tiny_gpt2_dir_160: Path) -> Path:
    return tiny_gpt2_dir_160


@pytest.fixture(scope="module")
def examples() -> list[str]:
    return read_lambada_jsonl(builtin_path("lambada_sample.jsonl"))


def hf_reference(model, tok, texts: list[str], vocab: int) -> list[tuple[float, bool]]:  # type: ignore[no-untyped-def]
    """Paper's strict rule on a plain HF forward per example: (summed target NLL, all-argmax)."""
    out = []
    for text in texts:
        word = text.split()[-1]
        ctx = tok.encode(text[: text.rfind(word)].strip(), add_special_tokens=False)
        tgt = tok.encode(" " + word, add_special_tokens=False)
        logp = reference_logprobs(model, ctx + tgt, vocab)[len(ctx) - 1 : -1]
        rows = torch.arange(len(tgt))
        out.append((-float(logp[rows, tgt].sum()), bool((logp.argmax(-1) == torch.tensor(tgt)).all())))
    return out


def test_strict_equals_hf_reference_and_batching_is_invariant(tiny_dir: Path, examples: list[str]) -> None:
    model, tok = load_tiny(tiny_dir)
    scorer = HFCausalLMScorer(model, vocab_size=len(tok), batch_size=4)
    reference = hf_reference(model, tok, examples, len(tok))
    one = score_lambada(scorer, tok, examples, batch_size=1, progress=False)
    four = score_lambada(scorer, tok, examples, batch_size=4, progress=False)
    assert not any(s.truncated for s in one)
    for (ref_nll, ref_ok), a, b in zip(reference, one, four):
        assert a.nll == pytest.approx(ref_nll, rel=1e-5) and a.correct == ref_ok
        # Right padding never changes an example (fp32 GEMM shapes differ, so allow rounding only).
        assert b.nll == pytest.approx(a.nll, rel=1e-6, abs=1e-9) and b.correct == a.correct
        assert b.target_tokens == a.target_tokens
    # The tiny model must not be trivially right or wrong for these checks to mean something.
    assert any(len(tok.encode(" " + e.split()[-1])) > 1 for e in examples)


def test_padded_vocab_rows_never_win(tmp_path: Path, examples: list[str]) -> None:
    directory = build_tiny_hf(tmp_path / "padded", n_positions=160, vocab_padding=16)
    model, tok = load_tiny(directory)
    assert model.config.vocab_size == len(tok) + 16
    with torch.no_grad():  # the rig works: untrimmed, a padded row is every argmax
        ids = tok.encode(examples[0], add_special_tokens=False)
        assert (model(torch.tensor([ids])).logits[0].argmax(-1) >= len(tok)).all()
    scorer = HFCausalLMScorer(model, vocab_size=len(tok), batch_size=8)
    reference = hf_reference(model, tok, examples[:10], len(tok))
    got = score_lambada(scorer, tok, examples[:10], progress=False)
    assert [g.correct for g in got] == [ok for _, ok in reference]
    assert [g.nll for g in got] == pytest.approx([n for n, _ in reference], rel=1e-5)


def test_nll_and_argmax_exclude_padding_and_follow_torch_ties() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 99.0], [0.0, 0.0, 0.0, 99.0], [2.0, 1.0, 0.0, 99.0]])
    out = nll_and_argmax(logits, torch.tensor([1, 2, -1]), vocab_size=3)
    assert out.is_argmax.tolist() == [True, False, False]  # ties: first index, as torch.argmax
    expected0 = -(3.0 - math.log(math.exp(1) + 2 * math.exp(3)))
    assert out.nll.tolist() == pytest.approx([expected0, math.log(3), 0.0])


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_cli_end_to_end(tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "res" / "lambada.json"
    base = ["lambada", "--hf-model", str(tiny_dir), "--data", "builtin:lambada_sample.jsonl", "--no-progress"]
    assert main([*base, "--out", str(out), "--batch-size", "16"]) == 0
    record = json.loads(out.read_text())
    assert record["task"] == "lambada" and record["method"] == "paper"
    assert record["metrics"]["count"] == 50 and 0.0 <= record["metrics"]["accuracy"] <= 1.0
    assert main([*base, "--last-token", "--results-dir", str(tmp_path / "rd")]) == 0
    written = list((tmp_path / "rd").glob("lambada-last-token-*.json"))
    assert len(written) == 1 and json.loads(written[0].read_text())["metrics"]["target_tokens"] == 50
    assert "accuracy" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("lines", "needle"),
    [
        (['{"text": "a b c"}', "{not json"], ":2: not valid JSON"),
        (['{"text": "a b c"}', "", '{"txt": "a b"}'], ":3: field 'text' missing or not a string"),
        (['{"text": "lonely"}'], ":1: text needs a context and a last word"),
        ([], "no LAMBADA examples"),
    ],
)
def test_cli_bad_data_exits_2_with_one_line(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], lines: list[str], needle: str
) -> None:
    data = write_lines(tmp_path / "lambada_test.jsonl", lines)
    with pytest.raises(SystemExit) as exc:
        main(["lambada", "--hf-model", str(tiny_dir), "--data", str(data), "--out", str(tmp_path / "x.json")])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {data}") and needle in err and "\n" not in err
    assert not (tmp_path / "x.json").exists()


def test_missing_file_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="missing.jsonl: file not found"):
        read_lambada_jsonl(tmp_path / "missing.jsonl")
