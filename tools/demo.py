"""The end-to-end demo on built-in defaults (``make demo``): the whole story in a few minutes on CPU.

1. train a tiny GPT-2 BPE tokenizer on the built-in corpus and preprocess the corpus
   (``mlm-preprocess``);
2. pretrain a tiny GPT with tp=2, pp=2 under ``torchrun`` (gloo), saving a checkpoint;
3. reshard it to tp=1, pp=1 (``mlm-convert reshard``) and inspect it;
4. convert it to a Hugging Face ``GPT2LMHeadModel`` (``mlm-convert to-hf``);
5. run lm-evaluation-harness on the toolkit's offline sample tasks (``mlm-lm-eval --model mlm``,
   ``mlm_eval/harness/tasks``), then evaluate WikiText-format perplexity and LAMBADA-format accuracy
   on the built-in samples (``mlm-eval wikitext103`` / ``lambada``) straight from the Megatron checkpoint;
6. pretrain a tiny BERT (``mlm-pretrain bert``) and finetune it on the built-in GLUE-format task
   (``mlm-finetune sst2``);
7. supervised fine-tuning with LoRA on the built-in chat data at tp=2 (``mlm-finetune sft``), the
   adapter exported for PEFT (``mlm-convert to-hf --lora-as adapter``) and checked in ``peft``
   against the merged export (``python -m finetune.sft.peft_check``);
8. write the leaderboard report (``mlm-eval report``) and print where it is.

Every step is the real command a user runs; outputs go to ``--out`` (default ``demo_out/``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from pretrain.data.builtin import builtin_corpus_path
from pretrain.tokenizer.train_tiny import train_tiny_gpt2_bpe, train_tiny_wordpiece

BIN = Path(sys.executable).parent


def run(title: str, cmd: list[str], *, env: dict[str, str] | None = None) -> None:
    print(f"\n=== {title}\n$ {' '.join(cmd)}", flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    if proc.returncode != 0:
        raise SystemExit(f"demo step failed ({title}): exit code {proc.returncode}")
    print(f"--- {title}: done in {time.perf_counter() - start:.1f}s", flush=True)


def tool(name: str) -> str:
    path = BIN / name
    return str(path) if path.exists() else name


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="demo_out")
    p.add_argument("--train-iters", type=int, default=200)
    p.add_argument("--no-harness", action="store_true", help="skip the lm-evaluation-harness step")
    p.add_argument("--no-sft", action="store_true", help="skip the SFT + LoRA step")
    return p


def gpt_corpus(out: Path) -> list[str]:
    """Step 1: ``out/gpt2_tokenizer/`` (a 1024-token GPT-2 BPE trained on the built-in corpus) and
    ``out/data/corpus_text_document`` (the corpus preprocessed with it); the tokenizer flags."""
    tok = train_tiny_gpt2_bpe(out / "gpt2_tokenizer", vocab_size=1024)
    tok_flags = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(tok / "vocab.json"),
                 "--merge-file", str(tok / "merges.txt")]  # fmt: skip
    run("preprocess the built-in corpus", [tool("mlm-preprocess"), "--input", str(builtin_corpus_path()),
        "--output-prefix", str(out / "data" / "corpus"), "--append-eod", "--workers", "1", *tok_flags])  # fmt: skip
    return tok_flags


def report_command(out: Path) -> list[str]:
    """Step 7: the leaderboard of ``out/results`` into ``out/report`` (with the paper's rows)."""
    return [tool("mlm-eval"), "report", "--results", str(out / "results"), "--out", str(out / "report"),
            "--with-paper"]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out).resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    results = out / "results"
    tok_flags = gpt_corpus(out)
    ckpt = out / "ckpt_tp2_pp2"
    run("pretrain a tiny GPT with tp=2, pp=2 (torchrun, gloo)", [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "-m", "pretrain.training.cli", "gpt",
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128",
        "--micro-batch-size", "4", "--global-batch-size", "16", "--train-iters", str(args.train_iters),
        "--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", "10", "--hidden-dropout", "0.0",
        "--attention-dropout", "0.0", "--data-path", str(out / "data" / "corpus_text_document"), "--split", "95,5,0",
        "--eval-interval", "50", "--eval-iters", "2", "--log-interval", "25", "--save", str(ckpt),
        "--log-json", str(out / "train_log.jsonl"), "--no-progress", *tok_flags,
    ])  # fmt: skip
    ckpt1 = out / "ckpt_tp1"
    run("reshard to tp=1, pp=1", [tool("mlm-convert"), "reshard", "--load", str(ckpt), "--save", str(ckpt1),
                                  "--target-tp", "1", "--target-pp", "1"])  # fmt: skip
    run("inspect the resharded checkpoint", [tool("mlm-convert"), "inspect", str(ckpt1)])
    run(
        "convert to Hugging Face",
        [tool("mlm-convert"), "to-hf", "--load", str(ckpt1), "--save", str(out / "hf_gpt2")],
    )
    if not args.no_harness:
        _harness(out, ckpt1)
    for task, data in (
        ("wikitext103", "builtin:wikitext_sample.tokens"),
        ("lambada", "builtin:lambada_sample.jsonl"),
    ):
        extra = ["--seq-length", "128", "--overlap", "32"] if task == "wikitext103" else []
        run(f"evaluate {task} (paper method) from the tp=2/pp=2 checkpoint", [
            tool("mlm-eval"), task, "--ckpt", str(ckpt), *tok_flags, "--data", data, *extra,
            "--name", "demo-gpt", "--out", str(results / f"{task}.json"),
        ])  # fmt: skip
    _finetune(out, results, args.train_iters // 2)
    if not args.no_sft:
        sft_lora_step(out)
    run("leaderboard report", report_command(out))
    print(f"\nDemo complete. Report: {out / 'report' / 'leaderboard.html'} (also .md, .csv, .json)")
    return 0


def _harness(out: Path, ckpt: Path) -> None:
    """lm-evaluation-harness on the toolkit's offline sample tasks, on our checkpoint as it is."""
    import importlib.util

    if importlib.util.find_spec("lm_eval") is None:
        print("\n=== lm-evaluation-harness: not installed (pip install -e '.[lm-eval]'), step skipped")
        return
    from mlm_eval.harness.tasks import TAG, TASKS_DIR

    run("lm-evaluation-harness sample tasks (offline) on the tp=1 checkpoint", [
        tool("mlm-lm-eval"), "--model", "mlm", "--model_args", f"ckpt={ckpt},batch_size=8", "--include_path",
        str(TASKS_DIR), "--tasks", TAG, "--device", "cpu", "--output_path", str(out / "lm_eval"),
    ], env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})  # fmt: skip


def _finetune(out: Path, results: Path, iters: int) -> None:
    wp = train_tiny_wordpiece(out / "bert_tokenizer", vocab_size=1024)
    tok_flags = ["--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", str(wp / "vocab.txt")]
    run("preprocess the built-in corpus for BERT (one sequence per sentence)", [tool("mlm-preprocess"),
        "--input", str(builtin_corpus_path()), "--output-prefix", str(out / "data" / "bert"), "--split-sentences",
        *tok_flags])  # fmt: skip
    bert = out / "ckpt_bert"
    run("pretrain a tiny BERT (masked LM + sentence order)", [
        tool("mlm-pretrain"), "bert", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--micro-batch-size", "16", "--global-batch-size", "16", "--train-iters", str(iters),
        "--lr", "2e-3", "--min-lr", "2e-4", "--lr-warmup-iters", "10", "--data-path", str(out / "data" / "bert_text_sentence"),
        "--split", "100,0,0", "--log-interval", "25", "--save", str(bert), "--no-progress", *tok_flags,
    ])  # fmt: skip
    run("finetune the tiny BERT on the built-in GLUE-format task (SST-2 format)", [
        tool("mlm-finetune"), "sst2", "--ckpt", str(bert), "--data-dir", "builtin:sst2_tiny",
        "--vocab-file", str(wp / "vocab.txt"), "--epochs", "10", "--seq-length", "32", "--micro-batch-size", "16",
        "--global-batch-size", "16", "--lr", "1e-3", "--results-dir", str(results / "finetune_sst2"), "--no-progress",
    ])  # fmt: skip


def sft_lora_step(out: Path) -> None:
    """Step 7 (see the module docstring): train, export and check, each a command of its own (the
    demo runs ``finetune`` and ``peft`` through their command lines, importing neither)."""
    if importlib.util.find_spec("peft") is None:
        print("\n=== SFT + LoRA: peft not installed (pip install -e '.[dev]'), step skipped")
        return
    base = out / "chat_llama"
    run("a tiny random Llama with the built-in chat tokenizer", [
        sys.executable, "-m", "finetune.sft.tiny_model", str(base)])  # fmt: skip
    lora = out / "sft_lora"
    run("LoRA SFT on the built-in chat data with tp=2 (torchrun, gloo)", [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "finetune.cli", "sft",
        "--hf-model", str(base), "--data", "builtin:sft_chat", "--tp", "2", "--lora-rank", "8",
        "--lora-alpha", "16", "--seq-length", "128", "--pack", "--epochs", "4", "--lr", "1e-2",
        "--global-batch-size", "8", "--micro-batch-size", "4", "--save", str(lora),
        "--results-dir", str(out / "sft_lora_results"), "--no-progress",
    ])  # fmt: skip
    convert = tool("mlm-convert")
    run("export the LoRA adapter for PEFT", [convert, "to-hf", "--load", str(lora), "--save",
        str(out / "sft_adapter"), "--lora-as", "adapter"])  # fmt: skip
    run("export the adapter merged into its base", [convert, "to-hf", "--load", str(lora), "--save",
        str(out / "sft_merged"), "--lora-as", "merged"])  # fmt: skip
    run("load the adapter with peft: equals the merged model", [sys.executable, "-m", "finetune.sft.peft_check",
        "--base", str(base), "--adapter", str(out / "sft_adapter"), "--merged", str(out / "sft_merged")])  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
