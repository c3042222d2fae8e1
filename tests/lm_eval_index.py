"""lm-evaluation-harness's index of its own tasks, built once per test run instead of once per
``TaskManager``.

Every ``TaskManager`` (one per ``simple_evaluate`` or ``lm_eval`` command, one per rank under a
launcher) walks the harness's ``lm_eval/tasks`` directory: about 12k YAML files, 26k loads, 12-33 s
of CPU on a 2-core host, where the evaluations the tests run take 3 s. :func:`install` wraps
``TaskIndex.build`` so that the index of that one directory (the installed package, which no test
changes) is built once per test run, pickled into the run's private directory :data:`CACHE_ENV`
(made by ``conftest.py``, inherited by every worker and subprocess) and unpickled (fresh objects)
by every later build, in any process of the run. Any other directory (the tests' own task files) is indexed
afresh each time. ``TaskIndex.build`` indexes each directory on its own and then merges them in
order, later ones overriding earlier ones with a warning; the wrapper keeps that order and that
warning, so the index is the one the harness builds.

A harness launch passes ``preload=LM_EVAL_INDEX`` (:mod:`tests.forked_launch` runs :func:`install`
before forking its ranks).
"""

from __future__ import annotations

import atexit
import fcntl
import logging
import os
import pickle
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

CACHE_ENV = "MLM_TESTS_LM_EVAL_INDEX_DIR"  # the test run's directory for the pickled index
LM_EVAL_INDEX = ("tests.lm_eval_index:install",)  # the ``preload`` of a harness launch
_log = logging.getLogger("lm_eval.tasks._index")  # the harness's own logger for the override warning


def install() -> None:
    """Make ``lm_eval``'s ``TaskIndex.build`` reuse the index of its own tasks (idempotent)."""
    from lm_eval.tasks import _index

    cache_dir()  # now: in a launcher, before its forks, so that every rank shares it
    if hasattr(_index.TaskIndex.build, "_tests_plain"):  # installed already
        return
    own_build = _index.TaskIndex.build
    own_root = Path(_index.__file__).resolve().parent

    def build(paths: Iterable[Path], *, resolve_includes: bool = True) -> dict[str, Any]:
        index: dict[str, Any] = {}
        for root in paths:
            if Path(root).resolve() == own_root:
                part = _own_index(own_build, own_root, resolve_includes)
            else:
                part = own_build([Path(root)], resolve_includes=resolve_includes)
            for name, entry in part.items():
                if name in index:
                    _log.warning("Task '%s' from %s overrides existing task from %s", name, entry.yaml_path,
                                 index[name].yaml_path)  # fmt: skip
                index[name] = entry
        return index

    build._tests_plain = own_build  # type: ignore[attr-defined]  # the harness's own (for the test of this one)
    _index.TaskIndex.build = staticmethod(build)  # type: ignore[method-assign,assignment]


def _own_index(own_build: Any, own_root: Path, resolve_includes: bool) -> dict[str, Any]:
    """The harness's index of ``own_root``, as fresh objects: unpickled from the run's cache, which
    the first caller of the run builds (the others wait on its lock)."""
    cache = cache_dir() / f"own_tasks_{int(resolve_includes)}.pkl"
    with open(cache.with_suffix(".lock"), "w", encoding="utf-8") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not cache.is_file():
            part = own_build([own_root], resolve_includes=resolve_includes)
            tmp = cache.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(pickle.dumps(part))
            os.replace(tmp, cache)
            return part  # type: ignore[no-any-return]
        pickled = cache.read_bytes()
    return pickle.loads(pickled)  # type: ignore[no-any-return]  # this run's own file, in its private directory


def cache_dir() -> Path:
    """The run's directory (:data:`CACHE_ENV`); without one, a new private one for this process and
    its children, removed when this process exits."""
    if not os.environ.get(CACHE_ENV):
        made = tempfile.mkdtemp(prefix="mlm-tests-lm-eval-index-")
        atexit.register(shutil.rmtree, made, ignore_errors=True)
        os.environ[CACHE_ENV] = made
    return Path(os.environ[CACHE_ENV])


def task_manager(include_path: str | Path) -> Any:
    """``lm_eval.tasks.TaskManager(include_path=...)`` with :func:`install` in effect."""
    from lm_eval.tasks import TaskManager

    install()
    return TaskManager(include_path=str(include_path))
