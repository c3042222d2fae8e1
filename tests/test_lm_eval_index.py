"""The tests' shared index of lm-eval's own tasks (:mod:`tests.lm_eval_index`) is the index the
harness builds: the same entries (names, kinds, files, configs, tags) in the same order, and a
directory given after it still overrides its tasks, with the harness's warning."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.lm_eval_index import install

pytest.importorskip("lm_eval")


def _entries(index: dict) -> list[tuple]:
    return [(k, e.kind, e.yaml_path, e.cfg, e.tags) for k, e in index.items()]


@pytest.mark.slow
def test_the_shared_index_is_the_harness_own(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from lm_eval.tasks import _index

    own_root = Path(_index.__file__).resolve().parent
    current = _index.TaskIndex.build  # wrapped already when an earlier test in this process installed it
    plain = getattr(current, "_tests_plain", current)
    (tmp_path / "mine.yaml").write_text(
        "task: lambada_openai\ndataset_path: json\noutput_type: loglikelihood\n"
    )
    paths = [own_root, tmp_path]
    with caplog.at_level(logging.WARNING, logger="lm_eval.tasks._index"):
        reference = plain(paths)
        warned = [r.getMessage() for r in caplog.records]
        caplog.clear()
        install()
        try:
            first, again = _index.TaskIndex.build(paths), _index.TaskIndex.build(paths)
        finally:
            _index.TaskIndex.build = staticmethod(current)  # type: ignore[method-assign]
    assert _entries(first) == _entries(again) == _entries(reference) and len(reference) > 1000
    assert first["lambada_openai"].yaml_path == tmp_path / "mine.yaml"
    assert first["lambada_openai"] is not again["lambada_openai"]  # fresh objects for each build
    assert len(warned) == 1 and "'lambada_openai'" in warned[0] and "overrides" in warned[0]
    assert [r.getMessage() for r in caplog.records] == warned * 2
