"""Small lm-evaluation-harness tasks that run offline, shipped with the toolkit (package data).

The YAML files here are the harness's own task format; their documents come from the built-in
samples (:mod:`mlm_eval.builtin`) through :mod:`mlm_eval.harness.tasks.sample_data`, so nothing is
downloaded. Tag ``mlm_sample`` runs all four:

* ``mlm_sample_lambada``: ``lambada_openai``'s definition (loglikelihood; acc, perplexity);
* ``mlm_sample_wikitext``: the harness's ``wikitext`` (articles, loglikelihood_rolling;
  word_perplexity, byte_perplexity, bits_per_byte, with the harness's own detokenizer);
* ``mlm_sample_mc``: multiple choice (acc, acc_norm): a passage's last word among three others;
* ``mlm_sample_gen``: generate_until (exact_match): continue a passage, at most 6 tokens.

``python -m mlm_eval.harness.tasks`` prints this directory, for ``--include_path``.
"""

from __future__ import annotations

from pathlib import Path

TASKS_DIR = Path(__file__).resolve().parent
TASK_NAMES = ("mlm_sample_lambada", "mlm_sample_wikitext", "mlm_sample_mc", "mlm_sample_gen")
TAG = "mlm_sample"
