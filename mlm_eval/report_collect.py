"""Read and validate the result files behind ``mlm-eval report``.

Two formats are understood, both mapped onto one :class:`RunRecord`:

* our own ``mlm-toolkit/result/v1`` records (see :mod:`pretrain.utils.results`), written by
  ``mlm-eval`` and ``mlm-finetune``;
* lm-evaluation-harness result files (``{"results": {"wikitext": {"word_perplexity,none": ...}},
  "config": {"model_args": ...}}``, and the older form without the ``,none`` filter suffix),
  tagged with source ``lm-eval-harness`` and method ``lm-eval-harness``.

Accuracy-like metrics (accuracy, F1, exact match, MCC, correlations) are normalised to percent,
the scale of the paper's tables: harness values are always fractions; our records may say
``details.metric_scale = "percent" | "fraction"``, otherwise a record whose accuracy-like values all
lie in [-1, 1] is read as fractions. Anything else (unreadable, foreign, invalid) becomes a
:class:`SkippedFile` with a reason; collecting never raises for a bad file.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pretrain.utils.errors import UserError
from pretrain.utils.results import RESULT_SCHEMA, TASK_METRICS

LEADERBOARD_SCHEMA = "mlm-toolkit/leaderboard/v1"
SOURCE_TOOLKIT = "mlm-toolkit"
SOURCE_HARNESS = "lm-eval-harness"

# Shown beside TASK_METRICS: our --method lm-eval reports the harness's byte-level numbers too.
EXTRA_METRICS: dict[str, tuple[str, ...]] = {"wikitext103": ("byte_perplexity", "bits_per_byte")}
# Records in the result schema that describe data, not a model.
NON_MODEL_TASKS = frozenset({"contamination"})
_PERCENT_PREFIXES = ("accuracy", "acc", "f1", "exact_match", "em", "mcc", "pearson", "spearman")

# lm-evaluation-harness task -> (our task, {harness metric: our metric}).
HARNESS_TASKS: dict[str, tuple[str, dict[str, str]]] = {
    "wikitext": (
        "wikitext103",
        {
            "word_perplexity": "word_perplexity",
            "byte_perplexity": "byte_perplexity",
            "bits_per_byte": "bits_per_byte",
        },
    ),
    # Older harness versions call the LAMBADA perplexity "ppl".
    "lambada_openai": ("lambada", {"acc": "accuracy", "perplexity": "ppl", "ppl": "ppl"}),
    "lambada": ("lambada", {"acc": "accuracy", "perplexity": "ppl", "ppl": "ppl"}),
    "mnli": ("mnli", {"acc": "accuracy_m"}),
    "mnli_mismatch": ("mnli", {"acc": "accuracy_mm"}),
    "qqp": ("qqp", {"acc": "accuracy", "f1": "f1"}),
    "cola": ("cola", {"mcc": "mcc"}),
    "sst2": ("sst2", {"acc": "accuracy"}),
    "mrpc": ("mrpc", {"acc": "accuracy", "f1": "f1"}),
    "qnli": ("qnli", {"acc": "accuracy"}),
    "rte": ("rte", {"acc": "accuracy"}),
    "wnli": ("wnli", {"acc": "accuracy"}),
}


class MalformedResult(ValueError):
    """A JSON file that is not a usable result; the message is the reason shown to the user."""


@dataclass(frozen=True, kw_only=True)
class ModelKey:
    """Identity of one leaderboard row: a model at one checkpoint in one layout."""

    name: str
    iteration: int | None
    layout: str | None


@dataclass(frozen=True, kw_only=True)
class RunRecord:
    """One task result of one run, metrics on display scale (percent for accuracy-like)."""

    path: Path
    source: str
    kind: str
    task: str
    method: str
    model: ModelKey
    parameters: int | None
    checkpoint: str | None
    metrics: Mapping[str, float]
    seed: int | None
    created: _dt.datetime


@dataclass(frozen=True, kw_only=True)
class SkippedFile:
    """A JSON file that was not used, and why."""

    path: Path
    reason: str


@dataclass(frozen=True, kw_only=True)
class Collection:
    """Everything found under the result directories."""

    records: tuple[RunRecord, ...]
    skipped: tuple[SkippedFile, ...]
    directories: tuple[Path, ...]
    files_seen: int


def is_percent_metric(metric: str) -> bool:
    """Whether ``metric`` is accuracy-like (shown in percent, higher is better)."""
    name = metric.lower()
    return any(name == p or name.startswith(p + "_") for p in _PERCENT_PREFIXES)


def collect_results(directories: Sequence[str | Path]) -> Collection:
    """Read every ``*.json`` below ``directories`` (recursively); bad files are skipped with a reason."""
    dirs = tuple(Path(d) for d in directories)
    for d in dirs:
        if not d.is_dir():
            raise UserError(f"--results {d}: not a directory")
    records: list[RunRecord] = []
    skipped: list[SkippedFile] = []
    files = _json_files(dirs)
    for path in files:
        try:
            records.extend(read_result_file(path))
        except MalformedResult as exc:
            if str(exc) != LEADERBOARD_SCHEMA:  # our own report output is not a result, quietly
                skipped.append(SkippedFile(path=path, reason=str(exc)))
    return Collection(records=tuple(records), skipped=tuple(skipped), directories=dirs, files_seen=len(files))


def _json_files(dirs: Iterable[Path]) -> list[Path]:
    seen: dict[Path, Path] = {}
    for d in dirs:
        for path in sorted(d.rglob("*.json")):
            if path.is_file() and not path.name.startswith("."):
                seen.setdefault(path.resolve(), path)  # overlapping --results dirs count once
    return list(seen.values())


def read_result_file(path: Path) -> list[RunRecord]:
    """Parse one file into records; raises :class:`MalformedResult` with the reason otherwise."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise MalformedResult(f"unreadable: {exc}") from None
    except json.JSONDecodeError as exc:
        raise MalformedResult(f"not valid JSON (line {exc.lineno}, column {exc.colno})") from None
    if not isinstance(data, dict):
        raise MalformedResult(f"not a result: top level is a JSON {type(data).__name__}")
    if data.get("schema") == LEADERBOARD_SCHEMA:
        raise MalformedResult(LEADERBOARD_SCHEMA)
    if "schema" in data:
        if data["schema"] != RESULT_SCHEMA:
            raise MalformedResult(f"unknown schema {data['schema']!r} (expected {RESULT_SCHEMA!r})")
        return [_parse_toolkit(path, data)]
    if isinstance(data.get("results"), dict) and ("config" in data or "versions" in data):
        return _parse_harness(path, data)
    raise MalformedResult("not a result file: no 'schema' field and not lm-evaluation-harness output")


def _parse_toolkit(path: Path, data: dict[str, Any]) -> RunRecord:
    kind = _field(data, "kind", str)
    if kind not in ("eval", "finetune"):
        raise MalformedResult(f"field 'kind': expected 'eval' or 'finetune', got {kind!r}")
    task = _nonempty(_field(data, "task", str), "task")
    if task in NON_MODEL_TASKS:
        raise MalformedResult(f"task {task!r} is a data-hygiene result, not a model result")
    model = _field(data, "model", dict)
    details = data.get("details") or {}
    metrics = _metrics(_field(data, "metrics", dict), task)
    scale = details.get("metric_scale") if isinstance(details, dict) else None
    return RunRecord(
        path=path,
        source=SOURCE_TOOLKIT,
        kind=kind,
        task=task,
        method=_nonempty(_field(data, "method", str), "method"),
        model=ModelKey(
            name=_nonempty(_field(model, "name", str, "model.name"), "model.name"),
            iteration=_optional(model, "iteration", int, "model.iteration"),
            layout=_optional(model, "layout", str, "model.layout"),
        ),
        parameters=_optional(model, "parameters", int, "model.parameters"),
        checkpoint=_optional(model, "checkpoint", str, "model.checkpoint"),
        metrics=_to_percent(metrics, scale),
        seed=_optional(data, "seed", int, "seed"),
        created=_timestamp(_field(data, "created", str)),
    )


def _parse_harness(path: Path, data: dict[str, Any]) -> list[RunRecord]:
    raw_config = data.get("config")
    config: dict[str, Any] = raw_config if isinstance(raw_config, dict) else {}
    name = _harness_model_name(data, config)
    params = config.get("model_num_parameters")
    created = _harness_time(path, data)
    seed = config.get("random_seed")
    records: list[RunRecord] = []
    unknown: list[str] = []
    for harness_task, values in sorted(data["results"].items()):
        if harness_task not in HARNESS_TASKS or not isinstance(values, dict):
            unknown.append(str(harness_task))
            continue
        task, names = HARNESS_TASKS[harness_task]
        metrics = _harness_metrics(values, names)
        if metrics:
            records.append(
                RunRecord(
                    path=path,
                    source=SOURCE_HARNESS,
                    kind="eval",
                    task=task,
                    method=SOURCE_HARNESS,
                    model=ModelKey(name=name, iteration=None, layout=None),
                    parameters=params if _is_int(params) else None,
                    checkpoint=None,
                    metrics=_to_percent(metrics, "fraction"),
                    seed=seed if _is_int(seed) else None,
                    created=created,
                )
            )
    if not records:
        found = ", ".join(unknown) or "none"
        raise MalformedResult(f"lm-evaluation-harness file without a leaderboard task (tasks: {found})")
    return records


def _harness_metrics(values: dict[str, Any], names: dict[str, str]) -> dict[str, float]:
    """Keep unfiltered (``,none``) or suffix-less metrics; stderr and aliases are dropped."""
    out: dict[str, float] = {}
    for key, value in values.items():
        metric, _, filt = str(key).partition(",")
        if filt not in ("", "none") or metric not in names:
            continue
        if not _is_number(value):
            raise MalformedResult(f"results metric {key!r}: expected a finite number, got {value!r}")
        out[names[metric]] = float(value)
    return out


def _harness_model_name(data: dict[str, Any], config: dict[str, Any]) -> str:
    name = data.get("model_name")
    if not isinstance(name, str) or not name:
        args = config.get("model_args")
        if isinstance(args, str):
            args = dict(p.partition("=")[::2] for p in args.split(",") if p)
        name = args.get("pretrained") if isinstance(args, dict) else None
    if not isinstance(name, str) or not name:
        name = config.get("model") if isinstance(config.get("model"), str) else None
    if not name:
        raise MalformedResult("lm-evaluation-harness file: no model name in config.model_args")
    # A local path names the model by its last component.
    return name.rstrip("/").rsplit("/", 1)[-1] if name.startswith(("/", ".")) else name


def _harness_time(path: Path, data: dict[str, Any]) -> _dt.datetime:
    stamp: Any = data.get("date")
    # Older harness files carry no date: fall back to the file's modification time.
    seconds = float(stamp) if _is_number(stamp) else path.stat().st_mtime
    return _dt.datetime.fromtimestamp(seconds, tz=_dt.timezone.utc)


def _to_percent(metrics: dict[str, float], scale: Any) -> dict[str, float]:
    pct = [v for k, v in metrics.items() if is_percent_metric(k)]
    if scale not in ("percent", "fraction"):
        scale = "fraction" if pct and all(-1.0 <= v <= 1.0 for v in pct) else "percent"
    factor = 100.0 if scale == "fraction" else 1.0
    return {k: v * factor if is_percent_metric(k) else v for k, v in metrics.items()}


def leaderboard_metrics(task: str) -> tuple[str, ...] | None:
    """The metrics of ``task`` that become columns; ``None`` (all) for a task we do not know.

    Counts and diagnostics that runs also record (``count``, ``correct``, ``target_tokens``...)
    are not leaderboard columns.
    """
    if task not in TASK_METRICS:
        return None
    return (*TASK_METRICS[task], *EXTRA_METRICS.get(task, ()))


def _metrics(raw: dict[str, Any], task: str) -> dict[str, float]:
    wanted = leaderboard_metrics(task)
    out: dict[str, float] = {}
    for key, value in raw.items():
        if wanted is not None and key not in wanted:
            continue
        if not _is_number(value):
            raise MalformedResult(f"field 'metrics.{key}': expected a finite number, got {value!r}")
        out[str(key)] = float(value)
    if not out:
        expected = ", ".join(wanted or ("any number",))
        raise MalformedResult(f"field 'metrics' has no leaderboard metric for task {task!r} ({expected})")
    return out


def _timestamp(text: str) -> _dt.datetime:
    try:
        stamp = _dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise MalformedResult(f"field 'created': not an ISO-8601 time: {text!r}") from None
    return stamp if stamp.tzinfo else stamp.replace(tzinfo=_dt.timezone.utc)


def _field(obj: dict[str, Any], key: str, typ: type, label: str | None = None) -> Any:
    if key not in obj:
        raise MalformedResult(f"missing field {label or key!r}")
    value = obj[key]
    if not isinstance(value, typ) or isinstance(value, bool):
        raise MalformedResult(f"field {label or key!r}: expected {typ.__name__}, got {value!r}")
    return value


def _optional(obj: dict[str, Any], key: str, typ: type, label: str) -> Any:
    return None if obj.get(key) is None else _field(obj, key, typ, label)


def _nonempty(value: str, label: str) -> str:
    if not value.strip():
        raise MalformedResult(f"field {label!r} is empty")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
