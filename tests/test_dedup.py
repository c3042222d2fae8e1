"""Tests for ``mlm-dedup``: threshold behaviour against exact Jaccard, exact duplicates, determinism."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from pretrain.utils.errors import UserError
from tools.dedup import DedupConfig, main, run_dedup

K = 5  # shingle size used throughout (the default)


def brute_jaccard(a: list[str], b: list[str], k: int = K) -> float:
    """Independent reference: exact Jaccard of word k-gram tuple sets (texts here are pre-normalised)."""
    sa = {tuple(a[i : i + k]) for i in range(len(a) - k + 1)}
    sb = {tuple(b[i : i + k]) for i in range(len(b) - k + 1)}
    return len(sa & sb) / len(sa | sb)


class Words:
    """A source of fresh, never repeated lower-case words."""

    def __init__(self) -> None:
        self.count = 0

    def take(self, n: int) -> list[str]:
        out = [f"w{self.count + i}x" for i in range(n)]
        self.count += n
        return out


def variant(base: list[str], target: float, fresh: Words, rng: random.Random) -> list[str]:
    """Replace scattered words of ``base`` until the exact Jaccard drops to about ``target``."""
    doc = list(base)
    positions = list(range(len(doc)))
    rng.shuffle(positions)
    for pos in positions:
        if brute_jaccard(base, doc) <= target:
            break
        doc[pos] = fresh.take(1)[0]
    return doc


def write_corpus(path: Path, docs: list[list[str]]) -> list[str]:
    lines = [json.dumps({"id": f"d{i}", "text": " ".join(words)}) + "\n" for i, words in enumerate(docs)]
    path.write_text("".join(lines), encoding="utf-8")
    return lines


def run(tmp_path: Path, docs: list[list[str]], **kwargs) -> tuple[list[str], list[dict], list[str]]:
    lines = write_corpus(tmp_path / "in.jsonl", docs)
    config = DedupConfig(
        input=tmp_path / "in.jsonl",
        output=tmp_path / "out.jsonl",
        report=tmp_path / "rep.jsonl",
        progress=False,
        **kwargs,
    )
    stats = run_dedup(config)
    kept = (tmp_path / "out.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
    report = [json.loads(line) for line in (tmp_path / "rep.jsonl").read_text().splitlines()]
    assert stats.documents == len(docs) and stats.kept == len(kept) and stats.removed == len(report)
    return kept, report, lines


def test_known_similarities_removed_above_kept_below(tmp_path: Path) -> None:
    rng, fresh = random.Random(0), Words()
    base = fresh.take(300)
    docs = {
        "base": base,
        "j90": variant(base, 0.90, fresh, rng),
        "j30": variant(base, 0.30, fresh, rng),
        "exact": list(base),
        "other": fresh.take(300),
        "j82": variant(base, 0.82, fresh, rng),
        "j55": variant(base, 0.55, fresh, rng),
    }
    exact = {name: brute_jaccard(base, words) for name, words in docs.items()}
    assert 0.86 <= exact["j90"] <= 0.90 and 0.26 <= exact["j30"] <= 0.30 and exact["exact"] == 1.0
    names = list(docs)
    kept, report, lines = run(tmp_path, list(docs.values()))
    # j30 and j55 are also far below 0.7 from every other kept document.
    assert kept == [lines[names.index(n)] for n in ("base", "j30", "other", "j55")]
    removed = {names[r["line"] - 1]: r for r in report}
    assert set(removed) == {"j90", "exact", "j82"}
    for name, rec in removed.items():
        assert (
            rec["duplicate_of_line"] == 1
            and rec["duplicate_of_id"] == "d0"
            and rec["id"] == f"d{names.index(name)}"
        )
        assert abs(rec["jaccard_estimate"] - exact[name]) < 0.1  # MinHash error ~0.03 at 128 permutations
    assert removed["exact"]["jaccard_estimate"] == 1.0


def test_matches_brute_force_greedy_away_from_threshold(tmp_path: Path) -> None:
    """First-kept-wins decisions equal an exact-Jaccard brute force except within 0.1 of the threshold."""
    rng, fresh = random.Random(1), Words()
    docs: list[list[str]] = []
    for _ in range(12):
        base = fresh.take(150)
        group = [base] + [variant(base, t, fresh, rng) for t in (0.95, 0.85, 0.75, 0.65, 0.5, 0.2)]
        rng.shuffle(group)
        docs.extend(group)
    kept_lines, _, lines = run(tmp_path, docs, threshold=0.7)
    kept_set = set(kept_lines)
    reference_kept: list[list[str]] = []
    checked = 0
    for words, line in zip(docs, lines, strict=True):
        best = max((brute_jaccard(k, words) for k in reference_kept), default=0.0)
        decided_kept = line in kept_set
        if decided_kept:
            reference_kept.append(words)  # follow the tool so later comparisons use the same kept set
        if abs(best - 0.7) >= 0.1:
            checked += 1
            assert decided_kept == (best < 0.7), (best, decided_kept)
    assert checked >= 60


def test_exact_and_normalised_duplicates_always_removed(tmp_path: Path) -> None:
    rng, fresh = random.Random(2), Words()
    originals = [fresh.take(rng.randint(1, 40)) for _ in range(40)]  # includes docs shorter than K
    docs = originals + [list(d) for d in reversed(originals)]
    lines = write_corpus(tmp_path / "in.jsonl", docs)
    # Case, punctuation and spacing differences normalise away.
    lines.append(json.dumps({"id": "shout", "text": "  " + ",  ".join(originals[3]).upper() + "!"}) + "\n")
    (tmp_path / "in.jsonl").write_text("".join(lines))
    config = DedupConfig(
        input=tmp_path / "in.jsonl", output=tmp_path / "o.jsonl", report=tmp_path / "r.jsonl", progress=False
    )
    stats = run_dedup(config)
    assert stats.kept == 40 and stats.removed == 41
    report = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert all(r["jaccard_estimate"] == 1.0 for r in report)
    assert [r["duplicate_of_line"] for r in report[:40]] == list(range(40, 0, -1))
    assert report[-1]["id"] == "shout" and report[-1]["duplicate_of_line"] == 4
    assert (tmp_path / "o.jsonl").read_text() == "".join(lines[:40])


def test_deterministic_across_workers_and_runs(tmp_path: Path) -> None:
    rng, fresh = random.Random(3), Words()
    docs = []
    for _ in range(30):
        base = fresh.take(60)
        docs += [base, variant(base, 0.8, fresh, rng), fresh.take(60)]
    write_corpus(tmp_path / "in.jsonl", docs)
    outputs = []
    for run_id, workers in enumerate((1, 2, 1)):
        out, rep = tmp_path / f"o{run_id}.jsonl", tmp_path / f"r{run_id}.jsonl"
        run_dedup(
            DedupConfig(
                input=tmp_path / "in.jsonl",
                output=out,
                report=rep,
                workers=workers,
                chunk_size=7,
                progress=False,
            )
        )
        outputs.append((out.read_bytes(), rep.read_bytes()))
    assert outputs[0] == outputs[1] == outputs[2]
    assert outputs[0][1]  # something was removed


def test_cli_writes_outputs_and_summary(tmp_path: Path) -> None:
    fresh = Words()
    a = fresh.take(20)
    write_corpus(tmp_path / "in.jsonl", [a, fresh.take(20), a])
    argv = ["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl")]
    code = main(
        [*argv, "--summary", str(tmp_path / "s.json"), "--shingle-size", "3", "--num-perm", "64", "--quiet"]
    )
    assert code == 0
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 2
    report = [json.loads(x) for x in (tmp_path / "out.removed.jsonl").read_text().splitlines()]
    assert report == [
        {"line": 3, "id": "d2", "duplicate_of_line": 1, "duplicate_of_id": "d0", "jaccard_estimate": 1.0}
    ]
    summary = json.loads((tmp_path / "s.json").read_text())
    assert (summary["documents"], summary["kept"], summary["removed"]) == (3, 2, 1)


def test_bad_input_is_a_user_error_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "in.jsonl").write_text('{"text": "a b c"}\n{"text": 5}\n')
    with pytest.raises(SystemExit) as exc:
        main(["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"), "--quiet"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "in.jsonl:2" in err and "'text'" in err and "Traceback" not in err
    assert not (tmp_path / "out.jsonl").exists() and list(tmp_path.iterdir()) == [tmp_path / "in.jsonl"]
    with pytest.raises(UserError, match="threshold"):
        DedupConfig(input=tmp_path / "in.jsonl", output=tmp_path / "o", report=tmp_path / "r", threshold=0.0)
