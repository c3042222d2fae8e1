"""mlm-eval on Megatron-layout checkpoints: equals the exported Hugging Face model, any layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlm_eval.cli import main as eval_main
from tools.convert_cli import main as convert_main


@pytest.fixture(scope="module")
def trained(trained_gpt: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("evalckpt")
    data, ckpt = trained_gpt, Path(trained_gpt["ckpt"])
    hf = root / "hf"
    tok_dir = str(Path(data["vocab"]).parent)
    assert convert_main(["to-hf", "--load", str(ckpt), "--save", str(hf), "--tokenizer-dir", tok_dir]) == 0
    pp2 = root / "ckpt_pp2"
    assert (
        convert_main(
            ["reshard", "--load", str(ckpt), "--save", str(pp2), "--target-tp", "2", "--target-pp", "2"]
        )
        == 0
    )
    return {**data, "ckpt": str(ckpt), "hf": str(hf), "pp2": str(pp2), "root": str(root)}


@pytest.mark.parametrize("task", ["wikitext103", "lambada"])
def test_ckpt_equals_exported_hf_model(trained: dict[str, str], task: str) -> None:
    data = "builtin:wikitext_sample.tokens" if task == "wikitext103" else "builtin:lambada_sample.jsonl"
    extra = ["--seq-length", "32", "--overlap", "8"] if task == "wikitext103" else []
    outs, fingerprints = {}, {}
    tok = [
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        trained["vocab"],
        "--merge-file",
        trained["merges"],
    ]
    for name, src in (("ckpt", ["--ckpt", trained["ckpt"]]), ("pp2", ["--ckpt", trained["pp2"], *tok]),
                      ("hf", ["--hf-model", trained["hf"]])):  # fmt: skip
        out = Path(trained["root"]) / f"{task}-{name}.json"
        assert eval_main([task, *src, "--data", data, *extra, "--out", str(out), "--no-progress"]) == 0
        record = json.loads(out.read_text())
        outs[name], fingerprints[name] = record["metrics"], record["model"]["fingerprint"]
    # One set of weights in three layouts/formats: one fingerprint (the leaderboard's row key).
    assert len(set(fingerprints.values())) == 1 and fingerprints["ckpt"].startswith("w2:")
    key = "adjusted_ppl" if task == "wikitext103" else "ppl"
    assert outs["ckpt"][key] == pytest.approx(outs["hf"][key], rel=1e-5)
    assert outs["pp2"][key] == pytest.approx(outs["ckpt"][key], rel=1e-6)
    if task == "lambada":
        assert outs["ckpt"]["correct"] == outs["hf"]["correct"] == outs["pp2"]["correct"]


def test_bert_checkpoint_is_refused_for_lm_eval(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        eval_main(["lambada", "--ckpt", str(tmp_path / "missing"), "--data", "builtin:lambada_sample.jsonl"])
    assert exc.value.code == 2 and "no such directory" in capsys.readouterr().err
