"""Local lm-evaluation-harness tasks (offline) and a trained tiny GPT with its Hugging Face export.

Four task files in the harness's own YAML format over JSON-lines data written here:

* ``lambada_local``: ``lambada_openai``'s definition (loglikelihood; acc, perplexity);
* ``wiki_local``: the harness's ``wikitext`` (loglikelihood_rolling; word_perplexity,
  byte_perplexity, bits_per_byte; its own ``preprocess_wikitext.py``);
* ``mc_local``: a multiple-choice task (acc, acc_norm): the last word of a LAMBADA passage
  among three distractors;
* ``gen_local``: a ``generate_until`` task (exact_match) that continues a passage until a
  blank line, at most 6 tokens.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from mlm_eval.builtin import builtin_path
from mlm_eval.tasks.wikitext import split_wikitext_documents

TASK_NAMES = ("lambada_local", "wiki_local", "mc_local", "gen_local")

WIKI_YAML = """task: wiki_local
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: !function preprocess_wikitext.wikitext_detokenizer
process_results: !function preprocess_wikitext.process_results
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""
LAMBADA_YAML = """task: lambada_local
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: loglikelihood
test_split: test
doc_to_text: "{{{{text.split(' ')[:-1]|join(' ')}}}}"
doc_to_target: "{{{{' '+text.split(' ')[-1]}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
MC_YAML = """task: mc_local
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""
GEN_YAML = """task: gen_local
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: generate_until
test_split: test
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def _lambada_texts(limit: int) -> list[str]:
    lines = builtin_path("lambada_sample.jsonl").read_text().splitlines()
    return [json.loads(x)["text"] for x in lines][:limit]


def _write_jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_tasks(root: Path, *, docs: int = 12) -> Path:
    """Write the four tasks and their data under ``root``; return the ``--include_path`` directory."""
    import lm_eval

    tasks = root / "tasks"
    tasks.mkdir(parents=True)
    texts = _lambada_texts(docs)
    raw = builtin_path("wikitext_sample.tokens").read_text(encoding="utf-8")
    wiki = _write_jsonl(root / "wiki.jsonl", [{"page": p} for p in split_wikitext_documents(raw)[:3]])
    lam = _write_jsonl(root / "lambada.jsonl", [{"text": t} for t in texts])
    words = [t.split()[-1] for t in texts]
    mc = []
    for i, text in enumerate(texts):
        choices = [" " + words[(i + k) % len(words)] for k in range(4)]
        mc.append({"context": text[: text.rfind(" ")], "choices": choices, "label": i % 4})
        choices.insert(i % 4, choices.pop(0))
    gen = [{"context": t[: t.rfind(" ")], "target": " " + t.split()[-1]} for t in texts]
    shutil.copy(Path(lm_eval.__file__).parent / "tasks/wikitext/preprocess_wikitext.py", tasks)
    (tasks / "wiki_local.yaml").write_text(WIKI_YAML.format(data=wiki))
    (tasks / "lambada_local.yaml").write_text(LAMBADA_YAML.format(data=lam))
    (tasks / "mc_local.yaml").write_text(MC_YAML.format(data=_write_jsonl(root / "mc.jsonl", mc)))
    (tasks / "gen_local.yaml").write_text(GEN_YAML.format(data=_write_jsonl(root / "gen.jsonl", gen)))
    return tasks


def export_hf(ckpt: str, vocab_dir: str, out: Path) -> Path:
    """``mlm-convert to-hf`` of ``ckpt`` with the tokenizer files in ``vocab_dir``."""
    from tools.convert_cli import main as convert_main

    assert convert_main(["to-hf", "--load", ckpt, "--save", str(out), "--tokenizer-dir", vocab_dir]) == 0
    return out
