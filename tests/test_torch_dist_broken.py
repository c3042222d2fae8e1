"""A broken ``torch_dist`` checkpoint (a truncated ``.distcp``, a corrupt ``.metadata``, an item that
cannot be read) is one line naming the file, exit code 2, in every command that reads checkpoints
(as a truncated legacy ``.pt`` is), and the truncation is found when the checkpoint is opened."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from mlm_eval.cli import main as eval_main
from mlm_eval.generation.cli import main as generate_main
from tests.cli_helpers import one_line_error
from tools.convert_cli import main as convert_main

DATA = "release/__0_0.distcp"


@pytest.fixture(scope="module")
def dist_ckpt(tiny_gpt2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A torch_dist checkpoint (with its tokenizer) of the tiny GPT-2."""
    ck = tmp_path_factory.mktemp("broken-dist") / "ck"
    argv = ["from-hf", "--load", str(tiny_gpt2_dir), "--save", str(ck), "--tp", "1", "--pp", "1"]
    assert convert_main([*argv, "--ckpt-format", "torch_dist"]) == 0
    return ck


def _truncated(ck: Path) -> tuple[Path, str]:
    path = ck / DATA
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path, "truncated"


def _corrupt_metadata(ck: Path) -> tuple[Path, str]:
    path = ck / "release" / ".metadata"
    data = bytearray(path.read_bytes())
    data[200::97] = bytes(b ^ 0x5A for b in data[200::97])
    path.write_bytes(bytes(data))
    return path, "cannot be read"


def _unreadable_item(ck: Path) -> tuple[Path, str]:
    """The size is right but the last item's zip directory is gone: found when its tensor is read."""
    path = ck / DATA
    data = bytearray(path.read_bytes())
    data[-22:] = bytes(22)
    path.write_bytes(bytes(data))
    return path, "cannot read tensor"


BREAKAGES: dict[str, Callable[[Path], tuple[Path, str]]] = {
    "truncated .distcp": _truncated,
    "corrupt .metadata": _corrupt_metadata,
    "unreadable item": _unreadable_item,
}
WIKI = ["wikitext103", "--data", "builtin:wikitext_sample.tokens", "--seq-length", "32", "--no-progress"]
COMMANDS: dict[str, tuple[Callable[[list[str]], object], Callable[[Path, Path], list[str]]]] = {
    "inspect": (convert_main, lambda ck, out: ["inspect", str(ck)]),
    "to-hf": (convert_main, lambda ck, out: ["to-hf", "--load", str(ck), "--save", str(out)]),
    "reshard": (
        convert_main,
        lambda ck, out: [
            "reshard",
            "--load",
            str(ck),
            "--save",
            str(out),
            "--target-tp",
            "2",
            "--target-pp",
            "1",
        ],
    ),  # fmt: skip
    "mlm-eval": (eval_main, lambda ck, out: [*WIKI, "--ckpt", str(ck), "--out", str(out / "r.json")]),
    "mlm-generate": (
        generate_main,
        lambda ck, out: ["--ckpt", str(ck), "--prompt", "the", "--max-new-tokens", "2"],
    ),
}


@pytest.mark.parametrize("breakage", list(BREAKAGES))
@pytest.mark.parametrize("command", list(COMMANDS))
def test_broken_torch_dist_is_one_line_naming_the_file(
    dist_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, breakage: str
) -> None:
    ck = tmp_path / "ck"
    shutil.copytree(dist_ckpt, ck)
    path, needle = BREAKAGES[breakage](ck)
    main, argv = COMMANDS[command]
    out = tmp_path / "out"
    if command == "inspect" and breakage == "unreadable item":  # inspect reads every tensor: a problem
        assert main([*argv(ck, out), "--json"]) == 1
        problems = json.loads(capsys.readouterr().out)["problems"]
        assert len(problems) == 1 and problems[0].startswith(f"{path}: cannot read tensor"), problems
        return
    err = one_line_error(main, argv(ck, out), capsys)
    assert err.startswith(f"error: {path}: {needle}"), err
    assert not out.exists()
