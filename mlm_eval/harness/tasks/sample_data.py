"""Documents of the shipped harness tasks, built from the built-in samples (no download).

Each function is a task's ``custom_dataset``: the harness calls it with the task's metadata as
keyword arguments and takes the ``test`` split of the returned ``DatasetDict``. Paths come from the
installed package, so the tasks run from any working directory (a YAML ``data_files`` path would be
read relative to the current directory by ``datasets``).
"""

from __future__ import annotations

import json
from typing import Any

import datasets

from mlm_eval.builtin import builtin_path
from mlm_eval.tasks.wikitext import split_wikitext_documents

CHOICES = 4  # the multiple-choice task: the true last word and three others


def _test_split(rows: list[dict[str, Any]]) -> datasets.DatasetDict:
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def _passages() -> list[str]:
    lines = builtin_path("lambada_sample.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["text"] for line in lines if line.strip()]


def lambada(**_: Any) -> datasets.DatasetDict:
    """``{"text"}``: LAMBADA-format passages, each ending in its target word."""
    return _test_split([{"text": t} for t in _passages()])


def wikitext(**_: Any) -> datasets.DatasetDict:
    """``{"page"}``: the WikiText-format sample's articles, split as the harness's dataset is."""
    raw = builtin_path("wikitext_sample.tokens").read_text(encoding="utf-8")
    return _test_split([{"page": p} for p in split_wikitext_documents(raw)])


def multiple_choice(**_: Any) -> datasets.DatasetDict:
    """``{"context", "choices", "label"}``: a passage without its last word, and four candidate
    words (its own at position ``label``, the others the next passages' last words)."""
    texts = _passages()
    words = [" " + t.split()[-1] for t in texts]
    rows = []
    for i, text in enumerate(texts):
        others = [words[(i + k) % len(words)] for k in range(1, CHOICES)]
        label = i % CHOICES
        rows.append({"context": text[: text.rfind(" ")], "choices": [*others[:label], words[i], *others[label:]],
                     "label": label})  # fmt: skip
    return _test_split(rows)


def generation(**_: Any) -> datasets.DatasetDict:
    """``{"context", "target"}``: a passage without its last word; the target is that word."""
    return _test_split([{"context": t[: t.rfind(" ")], "target": " " + t.split()[-1]} for t in _passages()])
