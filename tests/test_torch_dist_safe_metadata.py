"""A ``torch_dist`` ``.metadata`` is unpickled with an allow-list: torch's own reader would run it."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest

from pretrain.checkpoint.opener import find_iteration_dir, load_canonical
from pretrain.checkpoint.torch_dist.storage_dcp import read_real_dcp_metadata
from pretrain.checkpoint.torch_dist.writer import write_torch_dist
from pretrain.parallel.config import ParallelConfig
from pretrain.utils.errors import UserError
from tests.cli_helpers import one_line_error
from tests.test_torch_dist_reshard import _source
from tools.convert_cli import main as convert


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.marker}",))


def test_metadata_naming_a_callable_is_refused_in_one_line_and_never_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = _source()
    write_torch_dist(src, tmp_path / "d", ParallelConfig(tp=2, pp=1))
    got, _, _ = load_canonical(tmp_path / "d")  # a genuine .metadata reads through the allow-list
    assert sorted(got) == sorted(src.full)
    it_dir = find_iteration_dir(tmp_path / "d", None)[0]
    md = read_real_dcp_metadata(it_dir)
    marker = tmp_path / "pwned"
    md.planner_data = {"evil": _Evil(marker)}
    (it_dir / ".metadata").write_bytes(pickle.dumps(md))
    err = one_line_error(convert, ["inspect", str(tmp_path / "d")], capsys)
    assert ".metadata: unsafe checkpoint file" in err and "system" in err, err
    assert not marker.exists()


def test_metadata_that_is_not_dcp_metadata_is_one_line(tmp_path: Path) -> None:
    write_torch_dist(_source(), tmp_path / "d", ParallelConfig(tp=1, pp=1))
    it_dir = find_iteration_dir(tmp_path / "d", None)[0]
    (it_dir / ".metadata").write_bytes(pickle.dumps({"not": "metadata"}))
    with pytest.raises(UserError, match=r"\.metadata: holds a dict"):
        load_canonical(tmp_path / "d")
    (it_dir / ".metadata").write_bytes(b"\x80\x04trunc")
    with pytest.raises(UserError, match=r"\.metadata: cannot be read, truncated or corrupt"):
        load_canonical(tmp_path / "d")
