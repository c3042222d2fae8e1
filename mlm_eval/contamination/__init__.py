"""``mlm-eval contamination``: the share of an eval set's n-grams found in training corpora.

* :mod:`~mlm_eval.contamination.cli` -- the subcommand and :func:`run_contamination`;
* :mod:`~mlm_eval.contamination.ngrams` -- word normalisation, n-gram hashing, the corpus scan;
* :mod:`~mlm_eval.contamination.readers` -- eval sets and training corpora (JSON lines, indexed
  datasets, raw text).
"""
