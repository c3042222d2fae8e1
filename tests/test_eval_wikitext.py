"""WikiText evaluation: windowed NLL vs a brute-force HF reference, formulas by hand, lm-eval method, CLI."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from mlm_eval.builtin import builtin_path
from mlm_eval.cli import main
from mlm_eval.scoring.scorer import HFCausalLMScorer, ScoreOutput
from mlm_eval.tasks.detokenize import count_original_tokens, wikitext_detokenize
from mlm_eval.tasks.wikitext import (
    evaluate_wikitext_lm_eval,
    evaluate_wikitext_paper,
    lm_eval_rolling_windows,
    read_wikitext,
    split_wikitext_documents,
)
from tests.eval_helpers import load_tiny, reference_logprobs

SEQ, STRIDE = 24, 8  # small windows so the sample stream needs many of them


@pytest.fixture(scope="module")
def tiny_dir(tiny_gpt2_dir: Path) -> Path:
    return tiny_gpt2_dir


@pytest.fixture(scope="module")
def tiny(tiny_dir: Path):  # type: ignore[no-untyped-def]
    return load_tiny(tiny_dir)


@pytest.fixture(scope="module")
def raw_text() -> str:
    return read_wikitext(builtin_path("wikitext_sample.tokens"))


class IdentityEncoder:
    """Text "3 4 5" -> ids [3, 4, 5]: lets a fake scorer see absolute positions."""

    prefix_token_id = 0

    def encode(self, text: str) -> list[int]:
        return [int(x) for x in text.split()]


class RecordingScorer:
    """Fake scorer: nll = 0.5 for every target; records (first input id, target id) per scored target."""

    def __init__(self, max_length: int = 64, nll: float = 0.5) -> None:
        self.max_length, self.vocab_size, self.nll = max_length, 10**6, nll
        self.seen: list[tuple[int, int, list[int]]] = []

    def score(self, input_ids: torch.Tensor, target_ids: torch.Tensor) -> ScoreOutput:
        for row_in, row_t in zip(input_ids.tolist(), target_ids.tolist()):
            self.seen += [(row_in[0], t, row_in[: j + 1]) for j, t in enumerate(row_t) if t >= 0]
        mask = target_ids >= 0
        return ScoreOutput(nll=torch.where(mask, self.nll, 0.0).double(), is_argmax=torch.zeros_like(mask))


@pytest.mark.slow  # > 10 s
def test_paper_method_equals_brute_force_reference(tiny, raw_text: str) -> None:  # type: ignore[no-untyped-def]
    model, tok = tiny
    scorer = HFCausalLMScorer(model, vocab_size=len(tok), batch_size=3)
    got = evaluate_wikitext_paper(
        scorer, tok, raw_text, seq_length=SEQ, overlap=STRIDE, batch_size=5, progress=False
    )
    tokens = tok.encode(wikitext_detokenize(raw_text), add_special_tokens=False)
    # Reference: target t is scored with context tokens[start:t], start from the paper's rule stated
    # directly. Targets sharing a start are read off one plain unpadded forward (causal attention).
    by_start: dict[int, list[int]] = {}
    for t in range(1, len(tokens)):
        by_start.setdefault(0 if t <= SEQ else STRIDE * math.ceil((t - SEQ) / STRIDE), []).append(t)
    total = 0.0
    for start, targets in by_start.items():
        logp = reference_logprobs(model, tokens[start : targets[-1]], len(tok))
        total += -sum(float(logp[t - 1 - start, tokens[t]]) for t in targets)
    assert got["num_tokens"] == len(tokens) and got["scored_targets"] == len(tokens) - 1
    assert got["total_nll"] == pytest.approx(total, rel=1e-6)
    t_o = count_original_tokens(raw_text)
    assert got["num_original_tokens"] == t_o == len(raw_text.strip().split(" "))
    assert got["adjusted_ppl"] == pytest.approx(math.exp(total / (t_o - 1)), rel=1e-5)
    assert got["token_ppl"] == pytest.approx(math.exp(total / (len(tokens) - 1)), rel=1e-5)
    assert got["windows"] == 1 + math.ceil((len(tokens) - 1 - SEQ) / STRIDE)


def test_each_target_scored_once_with_its_context() -> None:
    stream = " ".join(str(i) for i in range(100))
    scorer = RecordingScorer()
    out = evaluate_wikitext_paper(scorer, IdentityEncoder(), stream, seq_length=10, overlap=3, progress=False)
    targets = [t for _, t, _ in scorer.seen]
    assert sorted(targets) == list(range(1, 100))  # ids are positions: every target exactly once
    for start, t, context in scorer.seen:
        assert context == list(range(start, t))  # contiguous context from the window start
        assert start == (0 if t <= 10 else 3 * math.ceil((t - 10) / 3))
    # Hand formulas: NLL = 99 * 0.5; T = 100 ids; T_o = 100 pieces.
    assert out["total_nll"] == pytest.approx(49.5)
    assert out["token_ppl"] == pytest.approx(math.exp(49.5 / 99))
    assert out["adjusted_ppl"] == pytest.approx(math.exp(49.5 / 99))


def test_adjusted_vs_token_ppl_and_upstream_clamp() -> None:
    # 7 original pieces ("1 2 3 4 5 6 7" detokenizes unchanged) but the encoder gives 4 ids.
    class HalfEncoder(IdentityEncoder):
        def encode(self, text: str) -> list[int]:
            return [int(x) for x in text.split()][::2]

    out = evaluate_wikitext_paper(
        RecordingScorer(nll=30.0), HalfEncoder(), "1 2 3 4 5 6 7", seq_length=4, overlap=2
    )
    assert out["num_tokens"] == 4 and out["num_original_tokens"] == 7
    assert out["total_nll"] == pytest.approx(90.0)
    assert out["token_ppl"] == pytest.approx(math.exp(90.0 / 3))  # exponent 30: unclamped
    assert out["adjusted_ppl"] == pytest.approx(math.exp(90.0 / 6))  # exponent 15
    assert out["token_ppl_upstream_clamped"] == pytest.approx(math.exp(20.0))
    assert out["adjusted_ppl_upstream_clamped"] == pytest.approx(math.exp(15.0))


def test_split_documents_like_the_harness_dataset() -> None:
    raw = " \n = A = \n \n a1 \n \n = = Sub = = \n \n a2 \n = B = \n \n b1 \n"
    pages = split_wikitext_documents(raw)
    # The leading " " line is whitespace-only, so dropped; "= = Sub = =" is not a top-level heading.
    assert pages == [" = A = \n \n a1 \n \n = = Sub = = \n \n a2 ", " = B = \n \n b1 \n"]
    assert [len(re.split(r"\s+", p)) for p in pages] == [12, 6]  # words as the harness counts them


def test_lm_eval_rolling_windows_by_hand() -> None:
    t = [10, 11, 12, 13, 14, 15, 16]
    p, i = 99, -1
    assert lm_eval_rolling_windows(t, p, 3) == [
        ([p, 10, 11], [10, 11, 12]),  # prefix token lets the first token be scored
        ([12, 13, 14], [13, 14, 15]),  # one carried token
        ([13, 14, 15], [i, i, 16]),  # last window: filled up with earlier context
    ]
    assert lm_eval_rolling_windows([], p, 3) == []
    assert lm_eval_rolling_windows([5], p, 3) == [([p], [5])]


def test_lm_eval_method_equals_brute_force_reference(tiny, raw_text: str) -> None:  # type: ignore[no-untyped-def]
    model, tok = tiny
    scorer = HFCausalLMScorer(model, vocab_size=len(tok), batch_size=4)
    got = evaluate_wikitext_lm_eval(scorer, tok, raw_text, seq_length=SEQ, batch_size=3, progress=False)
    loglik, words, nbytes, eot = 0.0, 0, 0, tok.eos_token_id
    for page in split_wikitext_documents(raw_text):
        words += len(re.split(r"\s+", page))
        nbytes += len(page.encode("utf-8"))
        tokens = tok.encode(wikitext_detokenize(page), add_special_tokens=False)
        # Targets come in chunks of SEQ; the first chunk is read after [EOT], a chunk ending at e
        # after tokens[e-SEQ-1 : k] (one carried token, the last chunk filled up to SEQ inputs).
        for lo in range(0, len(tokens), SEQ):
            e = min(lo + SEQ, len(tokens))
            context = [eot, *tokens[: e - 1]] if lo == 0 else tokens[e - SEQ - 1 : e - 1]
            logp = reference_logprobs(model, context, len(tok))
            loglik += sum(float(logp[len(context) - (e - k), tokens[k]]) for k in range(lo, e))
    assert got["loglikelihood"] == pytest.approx(loglik, rel=1e-6)
    assert got["words"] == words and got["bytes"] == nbytes and got["documents"] == 3
    assert got["word_perplexity"] == pytest.approx(math.exp(-loglik / words), rel=1e-5)
    assert got["byte_perplexity"] == pytest.approx(math.exp(-loglik / nbytes), rel=1e-5)
    assert got["bits_per_byte"] == pytest.approx(-loglik / nbytes / math.log(2), rel=1e-6)


def test_cli_end_to_end_writes_json(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "wt.json"
    for method in ("paper", "lm-eval"):
        argv = ["wikitext103", "--hf-model", str(tiny_dir), "--data", "builtin:wikitext_sample.tokens"]
        argv += ["--seq-length", "32", "--method", method, "--out", str(out), "--no-progress"]
        assert main(argv) == 0
        record = json.loads(out.read_text())
        assert record["task"] == "wikitext103" and record["method"] == method and record["kind"] == "eval"
        assert record["model"]["name"] == tiny_dir.name and record["model"]["parameters"] > 0
        key = "adjusted_ppl" if method == "paper" else "word_perplexity"
        assert math.isfinite(record["metrics"][key]) and record["metrics"][key] > 1
    assert "adjusted_ppl" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv_tail", "needle"),
    [
        (["--data", "/nonexistent/wiki.test.tokens"], "/nonexistent/wiki.test.tokens"),
        (["--data", "builtin:nope.tokens"], "nope.tokens"),
        (["--data", "builtin:wikitext_sample.tokens", "--overlap", "0"], "--overlap"),
        (["--data", "builtin:wikitext_sample.tokens", "--seq-length", "4096"], "--seq-length"),
        (
            ["--data", "builtin:wikitext_sample.tokens", "--vocab-file", "v.json"],
            "--vocab-file apply to --ckpt",
        ),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], argv_tail: list[str], needle: str
) -> None:
    out = tmp_path / "never.json"
    with pytest.raises(SystemExit) as exc:
        main(["wikitext103", "--hf-model", str(tiny_dir), "--out", str(out), "--no-progress", *argv_tail])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and needle in err and "\n" not in err
    assert not out.exists()


def test_cli_ckpt_that_is_not_a_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["wikitext103", "--ckpt", str(tmp_path), "--data", "builtin:wikitext_sample.tokens"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "not a Megatron checkpoint directory" in err and str(tmp_path) in err


def test_bad_utf8_names_file_and_line(tmp_path: Path) -> None:
    from pretrain.utils.errors import UserError

    bad = tmp_path / "wiki.test.tokens"
    bad.write_bytes(b" = A = \n ok \n bad \xff byte \n")
    with pytest.raises(UserError, match=rf"{re.escape(str(bad))}:3: not valid UTF-8"):
        read_wikitext(bad)


def test_model_flags_collect_into_a_frozen_spec() -> None:
    import dataclasses

    from mlm_eval.cli import build_parser
    from mlm_eval.scoring.model_loading import ModelSpec

    args = build_parser().parse_args(
        ["lambada", "--ckpt", "c", "--data", "d", "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v"]
        + ["--merge-file", "m", "--tokenizer-dir", "t"]
    )
    spec = ModelSpec.from_args(args)
    assert spec == ModelSpec(
        ckpt="c", tokenizer_type="GPT2BPETokenizer", vocab_file="v", merge_file="m", tokenizer_dir="t"
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.ckpt = "other"  # type: ignore[misc]
