"""Document-level WikiText rows (``{"page": ...}``, the harness's ``wikitext_document_level`` format)
are scored page by page as given, equal to lm-evaluation-harness run offline on the same file.

The pages are our own: articles without a heading, and articles holding a line that looks like a
top-level heading, so re-splitting the concatenated pages (the old behaviour) would score other
documents with other word and byte counts.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from mlm_eval.builtin import builtin_path
from mlm_eval.cli import main
from mlm_eval.tasks.wikitext import split_wikitext_documents
from tests.harness_fixtures import WIKI_YAML
from tests.lm_eval_index import task_manager

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def _pages() -> list[str]:
    raw = builtin_path("wikitext_sample.tokens").read_text(encoding="utf-8")
    articles = split_wikitext_documents(raw)
    pages = [articles[0], " no heading here , just text @-@ like this . \n", *articles[1:]]
    pages[-1] = pages[-1] + "\n = Not A New Article = \n more words after it . \n"
    return pages


@pytest.mark.slow
def test_page_rows_equal_the_harness(tiny_gpt2_dir: Path, tmp_path: Path) -> None:
    from lm_eval import simple_evaluate

    pages = _pages()
    assert split_wikitext_documents("\n".join(pages)) != pages  # re-splitting would score other documents
    data = tmp_path / "pages.jsonl"
    data.write_text("".join(json.dumps({"page": p}) + "\n" for p in pages), encoding="utf-8")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    shutil.copy(Path(lm_eval.__file__).parent / "tasks/wikitext/preprocess_wikitext.py", tasks)
    (tasks / "wiki_local.yaml").write_text(WIKI_YAML.format(data=data))
    peer = simple_evaluate(
        model="hf", model_args=f"pretrained={tiny_gpt2_dir},dtype=float32,max_length=64", tasks=["wiki_local"],
        task_manager=task_manager(tasks), device="cpu", batch_size=4,
    )["results"]["wiki_local"]  # fmt: skip
    out = tmp_path / "ours.json"
    argv = ["wikitext103", "--hf-model", str(tiny_gpt2_dir), "--data", str(data), "--method", "lm-eval",
            "--seq-length", "64", "--no-progress", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    ours = json.loads(out.read_text())["metrics"]
    assert main([*argv, "--text-column", "page"]) == 0  # named explicitly: the same pages
    assert json.loads(out.read_text())["metrics"] == ours
    assert ours["documents"] == len(pages)
    assert ours["words"] == sum(len(__import__("re").split(r"\s+", p)) for p in pages)
    for key in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
        assert ours[key] == pytest.approx(peer[f"{key},none"], rel=1e-6), key
