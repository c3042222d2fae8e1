"""A tiny preprocessed corpus and tokenizer for training tests (built once per session)."""

from __future__ import annotations

from pathlib import Path

from pretrain.data.builtin import builtin_corpus_path
from pretrain.tokenizer.train_tiny import train_tiny_gpt2_bpe
from tools.preprocess import main as preprocess_main


def make_gpt_data(root: Path) -> dict[str, str]:
    tok = train_tiny_gpt2_bpe(root / "tok")
    prefix = root / "corpus"
    rc = preprocess_main([
        "--input", str(builtin_corpus_path()), "--output-prefix", str(prefix),
        "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(tok / "vocab.json"),
        "--merge-file", str(tok / "merges.txt"), "--append-eod",
    ])  # fmt: skip
    assert rc == 0
    return {
        "data": f"{prefix}_text_document",
        "vocab": str(tok / "vocab.json"),
        "merges": str(tok / "merges.txt"),
    }


def gpt_args(data: dict[str, str], **overrides: object) -> list[str]:
    """Flags of a tiny fp32 GPT run on ``data`` (dropout off unless overridden)."""
    flags: dict[str, object] = {
        "num-layers": 4, "hidden-size": 32, "num-attention-heads": 4, "seq-length": 32,
        "micro-batch-size": 2, "global-batch-size": 8, "train-iters": 4, "lr": 1e-3,
        "lr-decay-style": "constant", "hidden-dropout": 0.0, "attention-dropout": 0.0, "log-interval": 1,
        "data-path": data["data"], "tokenizer-type": "GPT2BPETokenizer", "vocab-file": data["vocab"],
        "merge-file": data["merges"], "seed": 7,
    }  # fmt: skip
    flags.update(overrides)
    out: list[str] = []
    for key, value in flags.items():
        if value is True:
            out.append(f"--{key}")
        elif value is not None and value is not False:
            out += [f"--{key}", str(value)]
    return ["gpt", *out, "--no-progress"]


def make_bert_data(root: Path) -> dict[str, str]:
    from pretrain.tokenizer.train_tiny import train_tiny_wordpiece

    tok = train_tiny_wordpiece(root / "wp")
    prefix = root / "bert"
    rc = preprocess_main([
        "--input", str(builtin_corpus_path()), "--output-prefix", str(prefix),
        "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", str(tok / "vocab.txt"), "--split-sentences",
    ])  # fmt: skip
    assert rc == 0
    return {"data": f"{prefix}_text_sentence", "vocab": str(tok / "vocab.txt")}


def bert_args(data: dict[str, str], **overrides: object) -> list[str]:
    flags: dict[str, object] = {
        "data-path": data["data"], "tokenizer-type": "BertWordPieceLowerCase", "vocab-file": data["vocab"],
        "merge-file": None, "seq-length": 48, "split": "90,10,0",
    }  # fmt: skip
    flags.update(overrides)
    args = gpt_args({"data": "", "vocab": "", "merges": ""}, **flags)
    return ["bert", *args[1:]]
