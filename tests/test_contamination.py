"""Tests for ``mlm-eval contamination``: hand-computed overlaps, planted n-grams, brute-force reference."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from mlm_eval.cli import main as eval_main
from mlm_eval.contamination.cli import ContaminationConfig, run_contamination
from mlm_eval.contamination.ngrams import EvalNgramSet, NgramHasher, TrainScanner, normalise_words
from mlm_eval.contamination.readers import read_eval_examples
from pretrain.utils.errors import UserError

WIKI = (
    " \n = Alpha Article = \n \n The quick brown fox jumps over the lazy dog again and again . \n"
    " = = Section = = \n Nine @-@ inch nails is a band from Cleveland , Ohio . \n"
    " = Beta = \n Completely unrelated words appear in this article only here okay \n"
)


def config(tmp_path: Path, train: list[Path], task: str, data: Path, **kwargs) -> ContaminationConfig:
    return ContaminationConfig(train=tuple(train), eval_task=task, data=data, progress=False, **kwargs)


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return path


def test_normalisation_rule() -> None:
    assert normalise_words("Nine @-@ inch, 1 @,@ 000 don 't") == normalise_words("nine-inch 1,000 don't")
    assert normalise_words("Hello_World! Ünïcode ÀB 3.5") == ["hello", "world", "ünïcode", "àb", "3", "5"]


def test_hand_computed_wikitext_overlap(tmp_path: Path) -> None:
    (tmp_path / "wiki.test.raw").write_text(WIKI, encoding="utf-8")
    train = write_jsonl(
        tmp_path / "train.jsonl",
        [
            "THE quick brown fox jumps over the lazy dog again and again!",
            "Nine-inch nails is a band",
            "again section nine",
        ],
    )
    record = run_contamination(config(tmp_path, [train], "wikitext103", tmp_path / "wiki.test.raw", n=4))
    # Alpha Article has 24 words (= 21 4-grams): "alpha article" + 12 fox words + "section" + 9 band words.
    # Doc 1 covers 9 4-grams, doc 2 ("nine inch nails is a band") 3; doc 3 is too short.
    metrics, details = record["metrics"], record["details"]
    assert (metrics["eval_ngrams"], metrics["contaminated_ngrams"]) == (21 + 8, 12)
    assert metrics["share"] == pytest.approx(12 / 29) and metrics["unique_share"] == pytest.approx(12 / 29)
    assert details["examples"] == [
        {"name": "Alpha Article", "ngrams": 21, "contaminated": 12, "share": pytest.approx(12 / 21)},
        {"name": "Beta", "ngrams": 8, "contaminated": 0, "share": 0.0},
    ]
    assert [row["name"] for row in details["top"]] == ["Alpha Article", "Beta"]
    assert (details["train_documents"], details["train_ngrams"]) == (3, 9 + 3)
    assert record["task"] == "contamination" and record["kind"] == "eval"


def test_ngrams_do_not_cross_documents(tmp_path: Path) -> None:
    (tmp_path / "eval.txt").write_text("a b c d e f\n")
    split = write_jsonl(tmp_path / "split.jsonl", ["a b c", "d e f"])
    assert (
        run_contamination(config(tmp_path, [split], "text", tmp_path / "eval.txt", n=3))["metrics"][
            "contaminated_ngrams"
        ]
        == 2
    )
    # Raw text is one document: n-grams span line breaks.
    (tmp_path / "raw.txt").write_text("a b c\nd e f\n")
    assert (
        run_contamination(config(tmp_path, [tmp_path / "raw.txt"], "text", tmp_path / "eval.txt", n=3))[
            "metrics"
        ]["share"]
        == 1.0
    )


@pytest.mark.parametrize("percent", [0, 10, 25, 60])
def test_planted_share_is_reported(tmp_path: Path, percent: int) -> None:
    rng = random.Random(percent)
    n = 8
    examples = [[f"e{i}w{j}" for j in range(rng.randint(8, 40))] for i in range(30)]  # all words distinct
    ngrams = [ex[j : j + n] for ex in examples for j in range(len(ex) - n + 1)]
    planted = rng.sample(range(len(ngrams)), round(len(ngrams) * percent / 100))
    docs = [" ".join(ngrams[i]) for i in planted] + [" ".join(f"noise{k}" for k in range(50))]
    # Near misses: 7 of the 8 words, or the 8 words out of order.
    docs += [" ".join(g[:-1]) + " other" for g in ngrams[:20]] + [" ".join(reversed(g)) for g in ngrams[:20]]
    rng.shuffle(docs)
    write_jsonl(tmp_path / "eval.jsonl", [" ".join(ex) for ex in examples])
    write_jsonl(tmp_path / "train.jsonl", docs)
    record = run_contamination(
        config(tmp_path, [tmp_path / "train.jsonl"], "lambada", tmp_path / "eval.jsonl")
    )
    assert record["metrics"]["eval_ngrams"] == len(ngrams)
    assert record["metrics"]["contaminated_ngrams"] == len(planted)
    assert record["metrics"]["share"] == pytest.approx(percent / 100, abs=0.5 / len(ngrams) + 1e-9)


def brute_force(eval_texts: list[str], train_docs: list[str], n: int) -> list[tuple[int, int]]:
    """Independent reference with Python tuples and its own normalisation code."""

    def words(text: str) -> list[str]:
        return re.sub(r"[^0-9a-z\s]", " ", text.lower()).split()  # ASCII-only inputs below

    train = {tuple(w[i : i + n]) for d in train_docs for w in [words(d)] for i in range(len(w) - n + 1)}
    out = []
    for text in eval_texts:
        grams = [tuple(words(text)[i : i + n]) for i in range(len(words(text)) - n + 1)]
        out.append((len(grams), sum(g in train for g in grams)))
    return out


def test_matches_brute_force_with_repeats_and_punctuation(tmp_path: Path) -> None:
    rng = random.Random(7)
    vocab = ["the", "The", "cat", "dog,", "sat", "on", "mat.", "a", "(big)", "hat!"]

    def text(k: int) -> str:
        return " ".join(rng.choice(vocab) for _ in range(k))

    eval_texts = [text(rng.randint(0, 30)) for _ in range(40)]
    train_docs = [text(rng.randint(0, 25)) for _ in range(60)]
    write_jsonl(tmp_path / "eval.jsonl", eval_texts)
    write_jsonl(tmp_path / "t1.jsonl", train_docs[:30])
    write_jsonl(tmp_path / "t2.jsonl", train_docs[30:])
    record = run_contamination(
        config(
            tmp_path,
            [tmp_path / "t1.jsonl", tmp_path / "t2.jsonl"],
            "jsonl",
            tmp_path / "eval.jsonl",
            n=3,
            top=5,
        )
    )
    expected = [ex for ex in brute_force(eval_texts, train_docs, 3)]
    got = [(e["ngrams"], e["contaminated"]) for e in record["details"]["examples"]]
    assert got == expected
    assert 0 < record["metrics"]["share"] < 1
    shares = [(c / t if t else 0.0) for t, c in expected]
    order = sorted(range(len(shares)), key=lambda i: (-shares[i], -expected[i][1], i))[:5]
    assert [row["index"] for row in record["details"]["top"]] == order


def test_batch_boundaries_do_not_change_results() -> None:
    rng = random.Random(3)
    words = [f"w{rng.randrange(6)}" for _ in range(400)]
    eval_texts = [" ".join(words[i : i + 20]) for i in range(0, 400, 20)]
    train = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 30))) for _ in range(50)]
    seen = []
    for flush in (1, 7, 10_000):
        hasher = NgramHasher(4)
        eval_set = EvalNgramSet(hasher, eval_texts)
        scanner = TrainScanner(hasher, eval_set, flush_words=flush)
        for doc in train:
            half = len(doc) // 2
            cut = doc.rfind(" ", 0, half) + 1 if " " in doc[:half] else 0
            scanner.feed(doc[:cut], end_of_document=False)
            scanner.feed(doc[cut:], end_of_document=True)
        scanner.finish()
        seen.append(eval_set.seen.copy())
    assert (seen[0] == seen[1]).all() and (seen[1] == seen[2]).all() and seen[0].any()
    counts = brute_force(eval_texts, train, 4)
    assert eval_set.example_counts()[1].tolist() == [c for _, c in counts]


def test_eval_readers(tmp_path: Path) -> None:
    (tmp_path / "wiki.raw").write_text(WIKI, encoding="utf-8")
    examples = read_eval_examples("wikitext103", tmp_path / "wiki.raw")
    assert [e.name for e in examples] == ["Alpha Article", "Beta"]
    assert "= = Section = =" in examples[0].text and examples[0].text.startswith(" = Alpha Article = ")
    (tmp_path / "e.jsonl").write_text('{"id": "q1", "body": "x y"}\n\n{"id": 7, "body": "z"}\n')
    named = read_eval_examples("jsonl", tmp_path / "e.jsonl", text_key="body", id_key="id")
    assert [(e.name, e.text) for e in named] == [("q1", "x y"), ("7", "z")]
    (tmp_path / "t.txt").write_text("first\n\nthird\n")
    assert [e.name for e in read_eval_examples("text", tmp_path / "t.txt")] == ["line 1", "line 3"]


def test_cli_writes_result_and_reports_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "wiki.raw").write_text(WIKI, encoding="utf-8")
    (tmp_path / "train.txt").write_text("completely unrelated words appear in this\narticle only here\n")
    out = tmp_path / "results" / "contamination.json"
    argv = ["contamination", "--train", str(tmp_path / "train.txt"), "--eval", "wikitext103"]
    argv += ["--data", str(tmp_path / "wiki.raw"), "--n", "8", "--top", "1", "--json", str(out), "--quiet"]
    code = eval_main(argv)
    assert code == 0
    record = json.loads(out.read_text())
    # Beta has 11 words ("beta" ... "okay") = 4 8-grams; the 9 training words, one document across
    # the line break, hold 2 of them.
    assert record["details"]["top"] == [
        {"name": "Beta", "ngrams": 4, "contaminated": 2, "share": 0.5, "index": 1}
    ]
    assert record["metrics"]["contaminated_ngrams"] == 2 and record["method"] == "wikitext103-8gram"
    assert "Beta" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        eval_main(
            [
                "contamination",
                "--train",
                str(tmp_path / "missing.jsonl"),
                "--eval",
                "lambada",
                "--data",
                str(tmp_path / "wiki.raw"),
            ]
        )
    assert exc.value.code == 2
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"txt": "b"}\n')
    with pytest.raises(SystemExit):
        eval_main(
            [
                "contamination",
                "--train",
                str(tmp_path / "train.txt"),
                "--eval",
                "lambada",
                "--data",
                str(tmp_path / "bad.jsonl"),
            ]
        )
    assert "bad.jsonl:2" in capsys.readouterr().err


def test_indexed_dataset_matches_jsonl(tmp_path: Path) -> None:
    from pretrain.data.indexed_dataset_builder import IndexedDatasetBuilder
    from pretrain.tokenizer.factory import TokenizerConfig, build_tokenizer
    from pretrain.tokenizer.train_tiny import train_tiny_gpt2_bpe

    rng = random.Random(5)
    vocab = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran", "far", "away"]
    docs = [" ".join(rng.choice(vocab) for _ in range(rng.randint(3, 30))) + "." for _ in range(40)]
    train_tiny_gpt2_bpe(tmp_path / "bpe", vocab_size=300, texts=docs * 3)
    tok_cfg = TokenizerConfig(
        tokenizer_type="GPT2BPETokenizer",
        vocab_file=str(tmp_path / "bpe" / "vocab.json"),
        merge_file=str(tmp_path / "bpe" / "merges.txt"),
    )
    tok = build_tokenizer(tok_cfg)
    with IndexedDatasetBuilder(tmp_path / "train_text_document") as builder:
        for doc in docs[:30]:
            assert tok.eod is not None
            builder.add_document([*tok.tokenize(doc), tok.eod])
    write_jsonl(tmp_path / "train.jsonl", docs[:30])
    write_jsonl(tmp_path / "eval.jsonl", docs[25:])
    results = [
        run_contamination(config(tmp_path, [train], "jsonl", tmp_path / "eval.jsonl", n=4, tokenizer=tok_cfg))
        for train in (tmp_path / "train_text_document", tmp_path / "train.jsonl")
    ]
    assert results[0]["details"]["examples"] == results[1]["details"]["examples"]
    assert results[0]["details"]["train_documents"] == 30
    assert 0 < results[0]["metrics"]["share"] < 1
    with pytest.raises(UserError, match="tokenizer-type"):
        run_contamination(
            config(tmp_path, [tmp_path / "train_text_document.bin"], "jsonl", tmp_path / "eval.jsonl")
        )
