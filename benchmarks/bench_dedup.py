"""Throughput and peak memory of ``mlm-dedup`` and of the ``mlm-eval contamination`` scan.

A synthetic JSON-lines corpus (default 100k documents, 40-200 words each, Zipf-distributed
words from a generated 30k-word list; generated with numpy in a few seconds) is written to a
temp dir with planted duplicates: ``--near-dup-share`` of the documents are copies of an
earlier document with one word in 80 replaced (at least one; 5-shingle Jaccard >= ~0.75, above
the 0.7 threshold)
and ``--exact-dup-share`` are verbatim copies. The eval set for the contamination scan has
``--eval-examples`` examples of 100 words, half of them cut from training documents.

Measured, each phase in a fresh (spawned) process so that peak RSS (``resource.getrusage``
``ru_maxrss``) belongs to that phase alone; wall seconds and CPU seconds (user + system, worker
processes included) are both reported, since CPU time is robust to other load on a shared
machine:

* ``dedup``: :func:`tools.dedup.run_dedup` (MinHash + LSH, ``--workers`` hashing processes):
  documents/s over the whole run (read, hash, LSH query/insert, write). The peak RSS of the
  parent (the LSH index) and of the largest worker are reported separately.
* ``exact`` (baseline): exact-duplicate removal by BLAKE2b of the normalised text in one process
  (what a plain script would do); it finds only the verbatim copies.
* ``contamination``: :func:`mlm_eval.contamination.cli.run_contamination` (8-grams): training
  n-grams scanned per second (whole run: read JSON, normalise, hash, match).
* ``ngram_set`` (baseline): the pure-Python scan -- a ``set`` of eval 8-gram tuples and a
  membership test per training window -- over the same data, checked to find the same distinct
  contaminated n-grams.

    python benchmarks/bench_dedup.py                    # 100k documents, --workers 2
    python benchmarks/bench_dedup.py --docs 20000       # quick

Last line: ``{"docs_per_s": ..., "ngrams_per_s": ..., "peak_rss_mb": ..., ...}``
(``peak_rss_mb``: the largest peak RSS of a process of ours: the dedup parent, a dedup worker,
or the contamination scan).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import resource
import string
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


def _rss_mb(who: int) -> float:
    return resource.getrusage(who).ru_maxrss / 1024.0  # Linux: KiB


def _cpu_s() -> float:
    """CPU seconds (user + system) of this process and its waited-for children."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


class Clock:
    """Wall and CPU seconds since creation (CPU time is robust to other load on a shared machine)."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), _cpu_s()

    def stop(self) -> dict[str, float]:
        return {"seconds": time.perf_counter() - self.wall, "cpu_s": _cpu_s() - self.cpu}


# ------------------------------------------------------------------------------------------ corpus
def make_vocab(rng: np.random.Generator, size: int) -> list[str]:
    """``size`` distinct lower-case pseudo-words of 2-10 letters."""
    letters = np.array(list(string.ascii_lowercase))
    words: set[str] = set()
    while len(words) < size:
        lengths = rng.integers(2, 11, size=size)
        chars = letters[rng.integers(0, 26, size=(size, 10))]
        words.update("".join(row[:n]) for row, n in zip(chars, lengths, strict=True))
    return sorted(words)[:size]


def generate_corpus(
    path: Path, eval_path: Path, *, docs: int, near_share: float, exact_share: float, eval_examples: int, seed: int
) -> tuple[dict[str, int], set[int]]:  # fmt: skip
    """Write the training corpus and the eval set; returns the planted counts and duplicate ids."""
    rng = np.random.default_rng(seed)
    vocab = np.array(make_vocab(rng, 30_000), dtype=object)
    probs = 1.0 / np.arange(1, len(vocab) + 1) ** 1.1
    probs /= probs.sum()
    lengths = rng.integers(40, 201, size=docs)
    ids = rng.choice(len(vocab), size=int(lengths.sum()), p=probs).astype(np.int32)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    kind = rng.random(docs)  # < near: near duplicate; < near + exact: exact duplicate
    kind[: max(1, docs // 100)] = 1.0  # the first documents are originals
    source = [0] * docs
    near = exact = 0
    planted: set[int] = set()
    with open(path, "w", encoding="utf-8") as fh:
        for i in range(docs):
            words = ids[starts[i] : starts[i + 1]]
            if kind[i] < near_share + exact_share:
                j = int(rng.integers(0, i))
                while source[j] != j:  # copy an original, not a copy
                    j = source[j]
                source[i] = j
                planted.add(i)
                words = ids[starts[j] : starts[j + 1]].copy()
                if kind[i] < near_share:  # one word per 80 replaced: 5-shingle Jaccard >= ~0.75
                    k = max(1, len(words) // 80)
                    words[rng.choice(len(words), size=k, replace=False)] = rng.integers(0, len(vocab), size=k)
                    near += 1
                else:
                    exact += 1
            else:
                source[i] = i
            text = " ".join(vocab[words])
            fh.write(f'{{"id": {i}, "text": "{text[0].upper()}{text[1:]}."}}\n')
    with open(eval_path, "w", encoding="utf-8") as fh:
        for k in range(eval_examples):
            w: np.ndarray
            if k % 2 == 0:  # cut from a training document
                j = int(rng.integers(0, docs))
                w = ids[starts[j] : starts[j + 1]][:100]
            else:
                w = rng.choice(len(vocab), size=100, p=probs)
            fh.write(json.dumps({"text": " ".join(vocab[w])}) + "\n")
    return {"near_duplicates": near, "exact_duplicates": exact}, planted


# ------------------------------------------------------------------------------------------ phases
def phase_dedup(corpus: Path, out_dir: Path, workers: int) -> dict[str, Any]:
    from tools.dedup import DedupConfig, run_dedup

    cfg = DedupConfig(input=corpus, output=out_dir / "dedup.jsonl", report=out_dir / "removed.jsonl",
                      workers=workers, progress=False)  # fmt: skip
    clock = Clock()
    stats = run_dedup(cfg)
    return {**clock.stop(), "documents": stats.documents, "removed": stats.removed,
            "worker_peak_rss_mb": _rss_mb(resource.RUSAGE_CHILDREN)}  # fmt: skip


def phase_exact(corpus: Path, out_dir: Path, workers: int) -> dict[str, Any]:
    from tools.hygiene.shingles import normalise_words

    clock = Clock()
    seen: set[bytes] = set()
    documents = removed = 0
    with open(corpus, "rb") as fh, open(out_dir / "exact.jsonl", "wb") as out:
        for raw in fh:
            documents += 1
            key = hashlib.blake2b(
                " ".join(normalise_words(json.loads(raw)["text"])).encode(), digest_size=16
            ).digest()
            if key in seen:
                removed += 1
                continue
            seen.add(key)
            out.write(raw)
    return {**clock.stop(), "documents": documents, "removed": removed}


def phase_contamination(corpus: Path, eval_path: Path) -> dict[str, Any]:
    from mlm_eval.contamination.cli import ContaminationConfig, run_contamination

    cfg = ContaminationConfig(train=(corpus,), eval_task="jsonl", data=eval_path, n=8, progress=False)
    clock = Clock()
    record = run_contamination(cfg)
    elapsed = clock.stop()
    d, m = record["details"], record["metrics"]
    return {**elapsed, "documents": d["train_documents"], "ngrams": d["train_ngrams"],
            "eval_unique_ngrams": d["eval_unique_ngrams"],
            "unique_contaminated": round(m["unique_share"] * d["eval_unique_ngrams"]), "share": m["share"]}  # fmt: skip


def phase_ngram_set(corpus: Path, eval_path: Path, n: int = 8) -> dict[str, Any]:
    from mlm_eval.contamination.ngrams import normalise_words

    clock = Clock()
    eval_set: set[tuple[str, ...]] = set()
    with open(eval_path, encoding="utf-8") as fh:
        for line in fh:
            w = normalise_words(json.loads(line)["text"])
            eval_set.update(tuple(w[i : i + n]) for i in range(len(w) - n + 1))
    found: set[tuple[str, ...]] = set()
    documents = ngrams = 0
    with open(corpus, encoding="utf-8") as fh:
        for line in fh:
            w = normalise_words(json.loads(line)["text"])
            documents += 1
            count = max(0, len(w) - n + 1)
            ngrams += count
            for i in range(count):
                g = tuple(w[i : i + n])
                if g in eval_set:
                    found.add(g)
    return {**clock.stop(), "documents": documents, "ngrams": ngrams,
            "eval_unique_ngrams": len(eval_set), "unique_contaminated": len(found)}  # fmt: skip


PHASES: dict[str, Callable[..., dict[str, Any]]] = {
    "dedup": phase_dedup,
    "exact": phase_exact,
    "contamination": phase_contamination,
    "ngram_set": phase_ngram_set,
}


def _child(name: str, args: tuple[Any, ...], queue: Any) -> None:
    try:
        result = PHASES[name](*args)
        result["peak_rss_mb"] = _rss_mb(resource.RUSAGE_SELF)
        queue.put(result)
    except BaseException as exc:  # report, do not hang the parent
        queue.put({"error": repr(exc)})
        raise


def run_phase(name: str, *args: Any) -> dict[str, Any]:
    """Run one phase in a fresh spawned interpreter; returns its measurements."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(name, args, queue))
    proc.start()
    result: dict[str, Any] = queue.get()
    proc.join()
    if "error" in result:
        raise RuntimeError(f"phase {name} failed: {result['error']}")
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", type=int, default=100_000)
    p.add_argument("--workers", type=int, default=2, help="dedup hashing processes")
    p.add_argument("--near-dup-share", type=float, default=0.05)
    p.add_argument("--exact-dup-share", type=float, default=0.02)
    p.add_argument("--eval-examples", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-baselines", action="store_true", help="skip the exact-hash and n-gram-set baselines")
    args = p.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench_dedup_") as tmp:
        root = Path(tmp)
        corpus, eval_path = root / "corpus.jsonl", root / "eval.jsonl"
        t = time.perf_counter()
        planted, planted_ids = generate_corpus(corpus, eval_path, docs=args.docs, near_share=args.near_dup_share,
                                  exact_share=args.exact_dup_share, eval_examples=args.eval_examples,
                                  seed=args.seed)  # fmt: skip
        gen_s = time.perf_counter() - t
        corpus_mb = corpus.stat().st_size / 2**20
        res: dict[str, dict[str, Any]] = {"dedup": run_phase("dedup", corpus, root, args.workers)}
        with open(root / "removed.jsonl", encoding="utf-8") as fh:
            removed_ids = {json.loads(line)["id"] for line in fh}
        if not args.no_baselines:
            res["exact"] = run_phase("exact", corpus, root, 1)
        res["contamination"] = run_phase("contamination", corpus, eval_path)
        if not args.no_baselines:
            res["ngram_set"] = run_phase("ngram_set", corpus, eval_path)

    dd, cc = res["dedup"], res["contamination"]
    peak = max(dd["peak_rss_mb"], dd["worker_peak_rss_mb"], cc["peak_rss_mb"])
    result: dict[str, Any] = {
        "docs_per_s": dd["documents"] / dd["seconds"],
        "ngrams_per_s": cc["ngrams"] / cc["seconds"],
        "peak_rss_mb": peak,
        "docs_per_cpu_s": dd["documents"] / dd["cpu_s"],
        "ngrams_per_cpu_s": cc["ngrams"] / cc["cpu_s"],
        "dedup_seconds": dd["seconds"],
        "dedup_cpu_s": dd["cpu_s"],
        "dedup_removed": dd["removed"],
        "dedup_recall": len(removed_ids & planted_ids) / max(len(planted_ids), 1),
        "dedup_false_positives": len(removed_ids - planted_ids),
        "planted_duplicates": planted,
        "dedup_parent_peak_rss_mb": dd["peak_rss_mb"],
        "dedup_worker_peak_rss_mb": dd["worker_peak_rss_mb"],
        "contamination_seconds": cc["seconds"],
        "contamination_cpu_s": cc["cpu_s"],
        "contamination_peak_rss_mb": cc["peak_rss_mb"],
        "train_ngrams": cc["ngrams"],
        "contamination_share": cc["share"],
        "docs": args.docs,
        "corpus_mb": corpus_mb,
        "generate_seconds": gen_s,
        "workers": args.workers,
        "cpus": os.cpu_count(),
        "loadavg_1m": os.getloadavg()[0],
    }
    rows = [("dedup (MinHash+LSH)", dd["documents"], "docs", dd)]
    if "exact" in res:
        ex = res["exact"]
        rows.append(("baseline exact hash", ex["documents"], "docs", ex))
        result["exact_hash_docs_per_s"] = ex["documents"] / ex["seconds"]
        result["dedup_vs_exact_ratio"] = result["docs_per_s"] / result["exact_hash_docs_per_s"]
        result["dedup_vs_exact_cpu_ratio"] = result["docs_per_cpu_s"] / (ex["documents"] / ex["cpu_s"])
    rows.append(("contamination scan", cc["ngrams"], "ngrams", cc))
    if "ngram_set" in res:
        ns = res["ngram_set"]
        rows.append(("baseline n-gram set", ns["ngrams"], "ngrams", ns))
        result["ngram_set_ngrams_per_s"] = ns["ngrams"] / ns["seconds"]
        result["contamination_vs_ngram_set_ratio"] = result["ngrams_per_s"] / result["ngram_set_ngrams_per_s"]
        result["contamination_vs_ngram_set_cpu_ratio"] = result["ngrams_per_cpu_s"] / (
            ns["ngrams"] / ns["cpu_s"]
        )
        result["contamination_matches_baseline"] = (
            ns["unique_contaminated"] == cc["unique_contaminated"] and ns["ngrams"] == cc["ngrams"]
        )
    planted_total = planted["near_duplicates"] + planted["exact_duplicates"]
    print(f"corpus: {args.docs} docs, {corpus_mb:.1f} MB, planted {planted_total} duplicates "
          f"({planted['near_duplicates']} near, {planted['exact_duplicates']} exact); generated in {gen_s:.1f} s")  # fmt: skip
    print(
        f"{'phase':<22}{'wall s':>8}{'CPU s':>8}{'per wall s':>13}{'per CPU s':>13} {'unit':<7}{'peak RSS MB':>12}"
    )
    for name, count, unit, r in rows:
        print(f"{name:<22}{r['seconds']:>8.1f}{r['cpu_s']:>8.1f}{count / r['seconds']:>13.0f}"
              f"{count / r['cpu_s']:>13.0f} {unit:<7}{r['peak_rss_mb']:>12.0f}")  # fmt: skip
    print(f"dedup removed {dd['removed']}: recall of planted {result['dedup_recall']:.4f}, "
          f"{result['dedup_false_positives']} not planted (workers' peak RSS {dd['worker_peak_rss_mb']:.0f} MB)"
          + (f"; exact hash removed {res['exact']['removed']}" if "exact" in res else ""))  # fmt: skip
    if "exact" in res:
        print(f"dedup / exact hash: {result['dedup_vs_exact_ratio']:.2f}x wall, "
              f"{result['dedup_vs_exact_cpu_ratio']:.2f}x CPU")  # fmt: skip
    if "ngram_set" in res:
        print(f"contamination / n-gram set: {result['contamination_vs_ngram_set_ratio']:.2f}x wall, "
              f"{result['contamination_vs_ngram_set_cpu_ratio']:.2f}x CPU; "
              f"same hits: {result['contamination_matches_baseline']}")  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
