"""Statements in README.md checked against what the code does (issue #25 item 11)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

README = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")


def _bash_block_after(marker: str) -> str:
    start = README.index(marker)
    block = README[README.index("```bash\n", start) + len("```bash\n") :]
    return block[: block.index("```")]


@pytest.mark.slow  # 2.4-15 s on a 2-core host: out of the fast lane (under 2 min)
def test_llama_command_runs_on_the_demos_outputs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The README's Llama-family command, as printed, in a directory holding what ``make demo``
    leaves in ``demo_out/`` (its step 1), trains with the losses the README states."""
    from pretrain.training.cli import main as pretrain_main
    from tools.demo import gpt_corpus

    text = _bash_block_after("After `make demo`")
    argv = shlex.split(text.replace("\\\n", " "))
    assert argv[:2] == ["mlm-pretrain", "gpt"]
    paths = [argv[i + 1] for i, a in enumerate(argv) if a in ("--data-path", "--vocab-file", "--merge-file")]
    assert paths and all(p.startswith("demo_out/") for p in paths), paths
    monkeypatch.chdir(tmp_path)
    gpt_corpus(tmp_path / "demo_out")
    capsys.readouterr()
    assert pretrain_main([*argv[1:], "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    claim = re.search(r"loss ([\d.]+) -> ([\d.]+) in (\d+) iterations", README)
    assert claim is not None
    first, final, iterations = claim.groups()
    assert summary["iterations"] == int(iterations) and abs(summary["first_loss"] - float(first)) < 0.02
    assert abs(summary["final_loss"] - float(final)) < 0.02


@pytest.mark.slow  # 2.4-15 s on a 2-core host: out of the fast lane (under 2 min)
def test_the_module_said_to_allow_list_namespace_does(tmp_path: Path) -> None:
    """README names the module whose import lets ``torch.load(weights_only=True)`` read our ``args``."""
    (module,) = re.findall(r"`argparse\.Namespace`\s+is allow-listed on import of `([\w.]+)`", README)
    code = (
        "import argparse, sys, torch\nimport importlib\nimportlib.import_module(sys.argv[1])\n"
        "print(argparse.Namespace in torch.serialization.get_safe_globals())"
    )

    def allow_listed(name: str) -> bool:
        out = subprocess.run([sys.executable, "-c", code, name], capture_output=True, text=True, check=True)
        return out.stdout.strip() == "True"

    assert allow_listed(module)
    assert not allow_listed("pretrain.checkpoint")  # the package alone does not (README says so)


def test_to_hf_writes_the_tokenizer_files_named(trained_gpt: dict[str, str], tmp_path: Path) -> None:
    from tools.convert_cli import main as convert_main

    sentence = README[README.index("* `to-hf` writes a complete Hugging Face tokenizer (") :]
    named = set(re.findall(r"`([\w.]+\.json)`", sentence[: sentence.index("which holds")]))
    out = tmp_path / "hf"
    tok_dir = str(Path(trained_gpt["vocab"]).parent)
    assert (
        convert_main(["to-hf", "--load", trained_gpt["ckpt"], "--save", str(out), "--tokenizer-dir", tok_dir])
        == 0
    )
    written = {p.name for p in out.iterdir()} - {"config.json", "generation_config.json", "model.safetensors"}
    assert written == named == {"tokenizer.json", "tokenizer_config.json"}
