"""Generate the built-in demo corpus from templates (deterministic for a seed).

Run ``python -m pretrain.data.builtin.generate`` to rewrite ``corpus.jsonl`` next to this file.
All names, places and sentences are invented for this project.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable
from pathlib import Path

NUM_DOCUMENTS = 300
SEED = 20240611

_NAMES = [
    "Ada", "Bram", "Cleo", "Dario", "Elin", "Farah", "Gus", "Hana", "Ivo", "Juno", "Kai", "Lena",
    "Milo", "Nora", "Otto", "Pia", "Quinn", "Rosa", "Sami", "Tess", "Ugo", "Vera", "Wim", "Yara",
]  # fmt: skip
_ANIMALS = ["fox", "owl", "rabbit", "badger", "heron", "otter", "sparrow", "tortoise", "goat", "cat", "dog"]
_PLACES = [
    "river",
    "old mill",
    "pine forest",
    "quiet lake",
    "stone bridge",
    "green hill",
    "orchard",
    "harbour",
]
_TOWNS = [
    "Brindlecombe", "Ashford Vale", "Marrowgate", "Elmstead", "Corran Bay", "Tallowmere", "Westerly",
    "Pennock", "Highcastle", "Lowbridge", "Fernhollow", "Saltmarsh",
]  # fmt: skip
_DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
_MONTHS = [
    "January", "February", "March", "April", "May", "June", "July", "August", "September",
    "October", "November", "December",
]  # fmt: skip
_DIRECTIONS = ["north", "south", "east", "west"]
_WEATHER = ["sunny", "cloudy", "rainy", "windy", "foggy", "snowy", "stormy", "mild"]
_COLOURS = ["red", "blue", "green", "yellow", "white", "orange", "purple", "brown"]
_OBJECTS = ["kite", "lantern", "basket", "boat", "scarf", "bicycle", "book", "teapot", "drum", "map"]
_FOODS = ["bread", "soup", "apple pie", "pancakes", "rice", "porridge", "vegetable stew", "lemon cake"]
_INGREDIENTS = [
    "flour", "butter", "sugar", "eggs", "milk", "salt", "onions", "carrots", "potatoes", "apples",
    "lemons", "honey", "oats", "beans", "tomatoes", "garlic",
]  # fmt: skip
_JOBS = ["baker", "teacher", "farmer", "painter", "sailor", "doctor", "gardener", "carpenter", "librarian"]
_NUMBER_WORDS = [
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
    "twelve",
]  # fmt: skip


def _a(phrase: str) -> str:
    """``phrase`` with the right indefinite article."""
    return ("an " if phrase[0] in "aeiou" else "a ") + phrase


def _story(rng: random.Random) -> str:
    name, friend = rng.sample(_NAMES, 2)
    animal, other = rng.sample(_ANIMALS, 2)
    place = rng.choice(_PLACES)
    obj = rng.choice(_OBJECTS)
    colour = rng.choice(_COLOURS)
    day = rng.choice(_DAYS)
    parts = [
        f"{name} the {animal} lived near the {place}.",
        f"Every morning {name} walked to the {place} and looked at the water.",
        f"One {day}, {name} found {_a(colour)} {obj} under a tree.",
        f"{name} did not know who had lost the {obj}, so {name} asked {friend} the {other}.",
        rng.choice(
            [
                f"{friend} said that the {obj} belonged to a child from the village.",
                f"{friend} thought the wind had carried the {obj} all the way from the hills.",
                f"{friend} laughed and said that the {obj} had been there since the spring.",
            ]
        ),
        rng.choice(
            [
                f"Together they carried the {obj} back to the village before the evening.",
                f"They decided to keep the {obj} safe until somebody came looking for it.",
                f"In the end they gave the {obj} to the oldest {rng.choice(_JOBS)} in the village.",
            ]
        ),
        rng.choice(
            [
                f"That night {name} slept well and dreamed of the {place}.",
                f"From that day on, {name} and {friend} were good friends.",
                f"{name} was happy, because helping others is a good way to spend a day.",
            ]
        ),
    ]
    return " ".join(parts)


def _weather(rng: random.Random) -> str:
    town = rng.choice(_TOWNS)
    day = rng.choice(_DAYS)
    month = rng.choice(_MONTHS)
    date = rng.randint(1, 28)
    cond = rng.choice(_WEATHER)
    low = rng.randint(-5, 15)
    high = low + rng.randint(3, 12)
    wind = rng.randint(5, 60)
    nxt = rng.choice(_WEATHER)
    lines = [
        f"Weather report for {town}, {day} {date} {month}.",
        f"The day will be {cond} with a high of {high} degrees and a low of {low} degrees.",
        f"The wind will blow at about {wind} kilometres per hour from the {rng.choice(_DIRECTIONS)}.",
        (
            "People are advised to carry an umbrella."
            if cond in ("rainy", "stormy")
            else "It is a good day to be outside."
            if cond in ("sunny", "mild")
            else "Drivers should take care on the roads."
        ),
        f"Tomorrow is expected to be {nxt}.",
    ]
    return " ".join(lines)


def _arithmetic(rng: random.Random) -> str:
    sentences = []
    for _ in range(rng.randint(4, 8)):
        a, b = rng.randint(0, 50), rng.randint(0, 50)
        op = rng.choice(["plus", "times", "minus"])
        if op == "plus":
            sentences.append(f"{a} plus {b} equals {a + b}.")
        elif op == "times":
            a, b = a % 13, b % 13
            sentences.append(f"{a} times {b} equals {a * b}.")
        else:
            a, b = max(a, b), min(a, b)
            sentences.append(f"{a} minus {b} equals {a - b}.")
    n = rng.randint(1, 12)
    sentences.append(f"The number {n} is written as {_NUMBER_WORDS[n]} in words.")
    return "Here are some sums. " + " ".join(sentences)


def _recipe(rng: random.Random) -> str:
    dish = rng.choice(_FOODS)
    items = rng.sample(_INGREDIENTS, rng.randint(3, 5))
    minutes = rng.choice([10, 15, 20, 25, 30, 40, 45, 60])
    serves = rng.randint(2, 8)
    steps = [
        f"How to make {dish}.",
        f"You will need {', '.join(items[:-1])} and {items[-1]}.",
        f"First, wash your hands and put the {items[0]} in a large bowl.",
        f"Next, add the {items[1]} and stir slowly.",
        f"Then add the {items[2]} and mix everything together.",
        f"Cook it for {minutes} minutes and let it cool a little.",
        f"This {dish} serves {serves} people.",
    ]
    return " ".join(steps)


def _town(rng: random.Random) -> str:
    town = rng.choice(_TOWNS)
    pop = rng.randint(2, 90) * 100
    job = rng.choice(_JOBS)
    place = rng.choice(_PLACES)
    colour = rng.choice(_COLOURS)
    return " ".join(
        [
            f"{town} is a small town with about {pop} people.",
            f"The town is known for its {place} and its {colour} houses.",
            f"Many people in {town} work as {_a(job)}.",
            f"There is a market every {rng.choice(_DAYS)}, where people sell {rng.choice(_FOODS)} "
            f"and {rng.choice(_OBJECTS)}s.",
            f"In {rng.choice(_MONTHS)} the town holds a festival with music and games.",
            f"Visitors say that {town} is a friendly place.",
        ]
    )


def _letter(rng: random.Random) -> str:
    sender, receiver = rng.sample(_NAMES, 2)
    town = rng.choice(_TOWNS)
    month = rng.choice(_MONTHS)
    return "\n".join(
        [
            f"Dear {receiver},",
            f"I hope you are well. I am writing to you from {town}, where it has been "
            f"{rng.choice(_WEATHER)} all week.",
            f"Last week I bought {_a(rng.choice(_COLOURS))} {rng.choice(_OBJECTS)} at the market.",
            f"I will visit you in {month}, and I will bring some {rng.choice(_FOODS)}.",
            "Please write back soon.",
            f"Your friend, {sender}",
        ]
    )


def _lists(rng: random.Random) -> str:
    kind = rng.randrange(3)
    if kind == 0:
        start = rng.randrange(7)
        days = [_DAYS[(start + i) % 7] for i in range(7)]
        return (
            f"The week starting on {days[0]} goes {', '.join(days[:-1])} and {days[-1]}. "
            f"After {days[-1]} comes {days[0]} again."
        )
    if kind == 1:
        start = rng.randrange(12)
        months = [_MONTHS[(start + i) % 12] for i in range(4)]
        return (
            f"After {months[0]} comes {months[1]}. After {months[1]} comes {months[2]}. "
            f"After {months[2]} comes {months[3]}. There are twelve months in a year."
        )
    start = rng.randint(1, 40)
    step = rng.randint(1, 5)
    nums = [str(start + i * step) for i in range(8)]
    return f"Counting up in steps of {step}: {', '.join(nums)}. The next number is {start + 8 * step}."


_KINDS: list[Callable[[random.Random], str]] = [
    _story,
    _weather,
    _arithmetic,
    _recipe,
    _town,
    _letter,
    _lists,
]


def generate_corpus(num_documents: int = NUM_DOCUMENTS, seed: int = SEED) -> list[str]:
    """The corpus documents, deterministic for ``(num_documents, seed)``."""
    rng = random.Random(seed)
    docs = []
    for i in range(num_documents):
        kind = _KINDS[i % len(_KINDS)] if i < len(_KINDS) else rng.choice(_KINDS)
        docs.append(kind(rng))
    return docs


def corpus_jsonl(num_documents: int = NUM_DOCUMENTS, seed: int = SEED) -> str:
    """The corpus as JSON lines text (``{"text": ...}`` per line)."""
    return "".join(
        json.dumps({"text": doc}, ensure_ascii=False) + "\n" for doc in generate_corpus(num_documents, seed)
    )


def main(argv: list[str] | None = None) -> int:
    out = Path(argv[0]) if argv else Path(__file__).with_name("corpus.jsonl")
    out.write_text(corpus_jsonl(), encoding="utf-8")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
