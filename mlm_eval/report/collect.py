"""Read and validate the result files behind ``mlm-eval report``.

Two formats are understood, both mapped onto one :class:`~mlm_eval.report.records.RunRecord`:

* our own ``mlm-toolkit/result/v1`` records (see :mod:`pretrain.utils.results`), written by
  ``mlm-eval`` and ``mlm-finetune``;
* lm-evaluation-harness result files (read by :mod:`mlm_eval.report.harness_results`).

Accuracy-like metrics (accuracy, F1, exact match, MCC, correlations) are normalised to percent,
the scale of the paper's tables. The report never guesses a unit from the values: a record with
the schema's ``units`` map (``{metric: "fraction" | "percent"}``; a metric not named is a plain
value) or an older single ``metric_unit``/``metric_scale`` is read as declared; an older record
without either is read by its producer's definition of the metric: ``mlm-eval`` (kind ``eval``)
and lm-evaluation-harness write fractions, ``mlm-finetune`` (kind ``finetune``) writes percent.

Besides the metrics, each record says how far it can be trusted: ``partial`` (``--limit N``),
the weights' ``dtype`` during evaluation (bf16/fp16 are reduced precision), ``sample_data`` (the
built-in samples, not the real test set) and the weights ``fingerprint`` (the row key, see
:mod:`pretrain.checkpoint.fingerprint`). Contamination records (task ``contamination``) are kept
apart as :class:`HygieneRecord`. Anything else (unreadable, foreign, invalid) becomes a
:class:`SkippedFile` with a reason; collecting never raises for a bad file.
"""

from __future__ import annotations

import datetime as _dt
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlm_eval.report.harness_results import parse_harness
from mlm_eval.report.records import (
    DTYPE_NAMES,
    LEADERBOARD_SCHEMA,
    SOURCE_TOOLKIT,
    UNITS,
    HygieneRecord,
    MalformedResult,
    ModelKey,
    RunRecord,
    SkippedFile,
    Units,
    is_int,
    is_number,
    to_percent,
)
from pretrain.utils.errors import UserError
from pretrain.utils.results import RESULT_SCHEMA, TASK_METRICS

# Shown beside TASK_METRICS: our --method lm-eval reports the harness's byte-level numbers too.
EXTRA_METRICS: dict[str, tuple[str, ...]] = {"wikitext103": ("byte_perplexity", "bits_per_byte")}
# Records in the result schema that describe data, not a model.
NON_MODEL_TASKS = frozenset({"contamination"})
# Each producer's definition of its accuracy-like metrics, for records that declare no unit.
_PRODUCER_SCALE = {"eval": "fraction", "finetune": "percent"}
_BUILTIN_DIRS = ("/mlm_eval/builtin/", "/finetune/builtin/")


@dataclass(frozen=True, kw_only=True)
class Collection:
    """Everything found under the result directories."""

    records: tuple[RunRecord, ...]
    skipped: tuple[SkippedFile, ...]
    directories: tuple[Path, ...]
    files_seen: int
    hygiene: tuple[HygieneRecord, ...] = ()
    ignored: tuple[Path, ...] = ()  # JSON files a record names as its own outputs: not results, quietly


def collect_results(directories: Sequence[str | Path]) -> Collection:
    """Read every ``*.json`` below ``directories`` (recursively); bad files are skipped with a reason."""
    dirs = tuple(Path(d) for d in directories)
    for d in dirs:
        if not d.is_dir():
            raise UserError(f"--results {d}: not a directory")
    records: list[RunRecord] = []
    hygiene: list[HygieneRecord] = []
    skipped: list[SkippedFile] = []
    files = _json_files(dirs)
    for path in files:
        try:
            for item in read_result_file(path):
                (hygiene if isinstance(item, HygieneRecord) else records).append(item)  # type: ignore[arg-type]
        except MalformedResult as exc:
            if str(exc) != LEADERBOARD_SCHEMA:  # our own report output is not a result, quietly
                skipped.append(SkippedFile(path=path, reason=str(exc)))
    owned = {p.resolve() for r in records for p in r.outputs}
    return Collection(
        records=tuple(records),
        skipped=tuple(s for s in skipped if s.path.resolve() not in owned),
        directories=dirs,
        files_seen=len(files),
        hygiene=tuple(hygiene),
        ignored=tuple(s.path for s in skipped if s.path.resolve() in owned),
    )


def _named_outputs(path: Path, details: dict[str, Any]) -> tuple[Path, ...]:
    """The files a record's runs say they wrote (``details.runs[].files``), found beside ``path``:
    they were written as ``RESULTS_DIR[/seed_K]/NAME`` and ``path`` is ``RESULTS_DIR/results.json``,
    so a relative ``RESULTS_DIR`` (from the producer's working directory) still resolves."""
    runs = details.get("runs")
    out = []
    for run in runs if isinstance(runs, list) else []:
        files = run.get("files") if isinstance(run, dict) else None
        for name in files if isinstance(files, list) else []:
            if isinstance(name, str) and name:
                named = Path(name)
                seed_dir = named.parent.name if re.fullmatch(r"seed_\d+", named.parent.name) else ""
                out.append(path.parent / seed_dir / named.name)
    return tuple(out)


def _json_files(dirs: Iterable[Path]) -> list[Path]:
    seen: dict[Path, Path] = {}
    for d in dirs:
        for path in sorted(d.rglob("*.json")):
            if path.is_file() and not path.name.startswith("."):
                seen.setdefault(path.resolve(), path)  # overlapping --results dirs count once
    return list(seen.values())


def read_result_file(path: Path) -> list[RunRecord | HygieneRecord]:
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
        if data.get("task") in NON_MODEL_TASKS:
            return [_parse_hygiene(path, data)]
        return [_parse_toolkit(path, data)]
    if isinstance(data.get("results"), dict) and ("config" in data or "versions" in data):
        return list(parse_harness(path, data))
    raise MalformedResult("not a result file: no 'schema' field and not lm-evaluation-harness output")


def _parse_toolkit(path: Path, data: dict[str, Any]) -> RunRecord:
    kind = _field(data, "kind", str)
    if kind not in ("eval", "finetune"):
        raise MalformedResult(f"field 'kind': expected 'eval' or 'finetune', got {kind!r}")
    task = _nonempty(_field(data, "task", str), "task")
    model = _field(data, "model", dict)
    raw_details = data.get("details")
    details: dict[str, Any] = raw_details if isinstance(raw_details, dict) else {}
    metrics = _metrics(_field(data, "metrics", dict), task)
    scaled, rule = to_percent(metrics, _declared_units(data, details), _PRODUCER_SCALE[kind])
    return RunRecord(
        path=path,
        source=SOURCE_TOOLKIT,
        kind=kind,
        task=task,
        method=_nonempty(_field(data, "method", str), "method"),
        model=_model_key(model),
        parameters=_optional(model, "parameters", int, "model.parameters"),
        checkpoint=_optional(model, "checkpoint", str, "model.checkpoint"),
        metrics=scaled,
        seed=_optional(data, "seed", int, "seed"),
        created=_timestamp(_field(data, "created", str)),
        dtype=_dtype(data, details),
        limit=_limit(data, details),
        sample_data=_sample_data(data, details),
        forced_tokenizer=_forced_tokenizer(model),
        unit_rule=rule,
        outputs=_named_outputs(path, details),
    )


def _model_key(model: dict[str, Any]) -> ModelKey:
    fingerprint = model.get("fingerprint")
    if fingerprint is not None and not (isinstance(fingerprint, str) and fingerprint.strip()):
        raise MalformedResult(f"field 'model.fingerprint': expected a string, got {fingerprint!r}")
    return ModelKey(
        name=_nonempty(_field(model, "name", str, "model.name"), "model.name"),
        iteration=_optional(model, "iteration", int, "model.iteration"),
        layout=_optional(model, "layout", str, "model.layout"),
        fingerprint=fingerprint,
    )


def _parse_hygiene(path: Path, data: dict[str, Any]) -> HygieneRecord:
    model = _field(data, "model", dict)
    raw_details = data.get("details")
    details: dict[str, Any] = raw_details if isinstance(raw_details, dict) else {}
    metrics = _field(data, "metrics", dict)
    share = metrics.get("share")
    if not is_number(share):
        raise MalformedResult(f"field 'metrics.share': expected a finite number, got {share!r}")
    method = _field(data, "method", str)
    eval_task = (
        details.get("eval_task") if isinstance(details.get("eval_task"), str) else method.split("-")[0]
    )
    n = details.get("n")
    units: Units | None = _declared_units(data, details)
    if units is not None and "share" not in (units.per_metric or {}) and units.all_metrics is None:
        units = None  # mlm-eval contamination's share is a fraction by definition
    (scaled, _) = to_percent({"share": float(share)}, units, "fraction")
    return HygieneRecord(
        path=path,
        name=_nonempty(_field(model, "name", str, "model.name"), "model.name"),
        fingerprint=model.get("fingerprint") if isinstance(model.get("fingerprint"), str) else None,
        eval_task=str(eval_task),
        n=n if is_int(n) else None,
        share=scaled["share"],
        created=_timestamp(_field(data, "created", str)),
    )


def _declared_units(data: dict[str, Any], details: dict[str, Any]) -> Units:
    per_metric: dict[str, str] | None = None
    for obj in (data, details):
        units = obj.get("units")
        if isinstance(units, dict) and per_metric is None:
            per_metric = {str(k): str(v) for k, v in units.items()}
    for obj in (data, details):
        for key in ("metric_unit", "metric_scale", "unit"):
            value = obj.get(key)
            if value is not None:
                if value not in UNITS:
                    raise MalformedResult(f"field {key!r}: expected 'percent' or 'fraction', got {value!r}")
                return Units(per_metric=per_metric, all_metrics=str(value))
    return Units(per_metric=per_metric)


def _dtype(data: dict[str, Any], details: dict[str, Any]) -> str | None:
    hyper = details.get("hyperparameters")
    for value in (
        data.get("dtype"),
        details.get("dtype"),
        isinstance(hyper, dict) and hyper.get("params_dtype"),
    ):
        if isinstance(value, str) and value:
            return DTYPE_NAMES.get(value, value)
    return None


def _limit(data: dict[str, Any], details: dict[str, Any]) -> int | None:
    for value in (data.get("limit"), details.get("limit")):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    if data.get("partial") is True or details.get("partial") is True:
        return 0  # partial without a recorded count
    return None


def _forced_tokenizer(model: dict[str, Any]) -> bool:
    """Whether ``--force-tokenizer`` overrode a check: ``model.tokenizer.forced`` lists what."""
    tok = model.get("tokenizer")
    return isinstance(tok, dict) and bool(tok.get("forced"))


def _sample_data(data: dict[str, Any], details: dict[str, Any]) -> bool:
    for value in (data.get("sample_data"), details.get("sample_data")):
        if isinstance(value, bool):
            return value
    label = details.get("data")  # older mlm-eval records: the data file's path or builtin:NAME
    if isinstance(label, str):
        return label.startswith("builtin:") or any(marker in label for marker in _BUILTIN_DIRS)
    return False


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
        if not is_number(value):
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
