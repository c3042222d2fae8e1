"""Deterministic generator of the built-in tiny data sets (``python -m finetune.builtin.generate [DIR]``).

The texts come from templates with a clear, learnable signal: SST-2 sentiment is carried by
positive or negative adjectives; SQuAD answers are the facts (year, founder, city, staff) asked
for by the question's wording; RACE answers are the options stated in the article.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path
from typing import Any

from pretrain.utils.atomic import atomic_open

POSITIVE = ("good", "great", "excellent", "wonderful", "fantastic", "superb", "delightful", "brilliant")
NEGATIVE = ("bad", "awful", "terrible", "dreadful", "boring", "poor", "horrible", "dull")
NOUNS = ("movie", "film", "plot", "acting", "story", "script", "cast", "soundtrack", "ending", "direction")
SST_TEMPLATES = (
    "the {noun} was {adj} .",
    "a {adj} {noun} .",
    "i found the {noun} {adj} .",
    "what a {adj} {noun} !",
    "overall the {noun} is {adj} and the {noun2} is {adj2} .",
    "the {noun} felt {adj} from start to finish .",
    "honestly , a {adj} {noun} with a {adj2} {noun2} .",
)
ORGS = (
    "Arvane",
    "Belmor",
    "Cadrix",
    "Dunwell",
    "Elstree",
    "Fennick",
    "Galtor",
    "Harwick",
    "Istova",
    "Jarrow",
    "Kelbury",
    "Lomax",
    "Morvane",
    "Norcott",
    "Oakhurst",
    "Pellow",
    "Quenby",
    "Rasmor",
    "Selwick",
    "Tarrant",
)
KINDS = ("company", "museum", "library", "university", "orchestra", "hospital", "foundation", "theatre")
PEOPLE = (
    "Anna Keller",
    "Boris Lind",
    "Clara Moss",
    "David Orr",
    "Elena Park",
    "Frank Quill",
    "Grace Rowe",
    "Henry Stone",
    "Irene Tate",
    "Jonas Vale",
)
CITIES = ("Lisbon", "Oslo", "Tallinn", "Porto", "Geneva", "Krakow", "Ghent", "Turin", "Bergen", "Leeds")
RACE_NAMES = ("Tom", "Lucy", "Sam", "Mia", "Jack", "Emma", "Leo", "Nina")
RACE_ITEMS = ("apples", "books", "kites", "shoes", "stamps", "shells", "pencils", "hats")
RACE_PLACES = (
    "the park",
    "the market",
    "the school",
    "the beach",
    "the library",
    "the zoo",
    "the farm",
    "the lake",
)


def _sst2_sentence(rng: random.Random, label: int) -> str:
    words = POSITIVE if label else NEGATIVE
    a, a2 = rng.sample(words, 2)
    n, n2 = rng.sample(NOUNS, 2)
    return rng.choice(SST_TEMPLATES).format(noun=n, noun2=n2, adj=a, adj2=a2)


def sst2_rows(rng: random.Random, n: int, exclude: set[str]) -> list[tuple[str, int]]:
    """``n`` distinct balanced (sentence, label) rows not in ``exclude``."""
    rows: list[tuple[str, int]] = []
    while len(rows) < n:
        label = len(rows) % 2
        s = _sst2_sentence(rng, label)
        if s not in exclude:
            exclude.add(s)
            rows.append((s, label))
    rng.shuffle(rows)
    return rows


def _answer(context: str, text: str) -> dict[str, Any]:
    # Word boundaries: a staff count such as "95" must not match inside the year "1995".
    match = re.search(rf"\b{re.escape(text)}\b", context)
    assert match is not None, (text, context)
    return {"text": text, "answer_start": match.start()}


def _paragraph(rng: random.Random, org: str, pid: str, with_impossible: bool) -> dict[str, Any]:
    kind, person, city = rng.choice(KINDS), rng.choice(PEOPLE), rng.choice(CITIES)
    year, staff = str(rng.randint(1850, 2015)), str(rng.randint(12, 950))
    name = f"the {org} {kind}"
    sentences = [
        f"{name[0].upper()}{name[1:]} was founded in {year} by {person}.",
        f"Its main building is in {city}, close to the old harbour.",
        f"Today it employs about {staff} people.",
    ]
    rng.shuffle(sentences)
    context = " ".join(sentences)
    facts = [
        (f"When was {name} founded?", year),
        (f"Who founded {name}?", person),
        (f"In which city is the main building of {name}?", city),
        (f"How many people does {name} employ?", staff),
    ]
    qas: list[dict[str, Any]] = []
    for q, ans in facts:
        qas.append({"id": f"{pid}-{len(qas)}", "question": q, "answers": [_answer(context, ans)]})
    if with_impossible:
        for q, ans in ((f"Who closed {name}?", person), (f"When did {name} move to {city}?", year)):
            qas.append(
                {
                    "id": f"{pid}-{len(qas)}",
                    "question": q,
                    "answers": [],
                    "is_impossible": True,
                    "plausible_answers": [_answer(context, ans)],
                }
            )
    if with_impossible:
        for qa in qas:
            qa.setdefault("is_impossible", False)
    return {"context": context, "qas": qas}


def squad_doc(rng: random.Random, orgs: list[str], per_org: int, version: str) -> dict[str, Any]:
    paragraphs = [
        _paragraph(rng, org, f"{org.lower()}{k}", version == "v2.0") for org in orgs for k in range(per_org)
    ]
    return {"version": version, "data": [{"title": "Tiny institutions", "paragraphs": paragraphs}]}


def race_doc(rng: random.Random) -> dict[str, Any]:
    name, item, place = rng.choice(RACE_NAMES), rng.choice(RACE_ITEMS), rng.choice(RACE_PLACES)
    count = rng.randint(2, 9)
    article = (
        f"On Saturday {name} went to {place}.\nThere {name} bought {count} {item} for a friend.\n"
        f"It was a sunny day and everybody was happy."
    )
    questions, options, answers = [], [], []
    for question, right, pool in (
        (f"Where did {name} go on Saturday?", place, RACE_PLACES),
        (f"{name} bought _ .", item, RACE_ITEMS),
        (f"How many {item} did {name} buy?", str(count), tuple(str(i) for i in range(2, 10))),
    ):
        opts = [*rng.sample([p for p in pool if p != right], 3), right]
        rng.shuffle(opts)
        questions.append(question)
        options.append(opts)
        answers.append("ABCD"[opts.index(right)])
    return {"article": article, "questions": questions, "options": options, "answers": answers, "id": ""}


def _write(path: Path, text: str) -> None:
    with atomic_open(path, "w", encoding="utf-8") as fh:
        fh.write(text)


def generate(root: Path) -> list[Path]:
    """Write every built-in data set under ``root``; returns the files written."""
    written: list[Path] = []
    rng = random.Random(1234)
    seen: set[str] = set()
    for split, n in (("train", 200), ("dev", 60)):
        rows = sst2_rows(rng, n, seen)
        path = root / "sst2_tiny" / f"{split}.tsv"
        _write(path, "sentence\tlabel\n" + "".join(f"{s}\t{y}\n" for s, y in rows))
        written.append(path)
    orgs = list(ORGS)
    for name, version in (("squad_tiny", "v1.1"), ("squad2_tiny", "v2.0")):
        for split, chosen, per_org in (("train", orgs[:14], 3), ("dev", orgs[14:], 2)):
            path = root / name / f"{split}.json"
            _write(path, json.dumps(squad_doc(rng, chosen, per_org, version), indent=1) + "\n")
            written.append(path)
    for split in ("train", "dev", "test"):
        for subset in ("middle", "high"):
            for k in range(2):
                path = root / "race_tiny" / split / subset / f"{k + 1}.txt"
                doc = race_doc(rng)
                doc["id"] = f"{subset}{k + 1}.txt"
                _write(path, json.dumps(doc) + "\n")
                written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("root", nargs="?", default=str(Path(__file__).resolve().parent))
    args = parser.parse_args(argv)
    for path in generate(Path(args.root)):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
