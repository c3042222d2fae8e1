"""The zero-shot tasks of ``mlm-eval``: WikiText-103 perplexity and LAMBADA cloze accuracy.

The methods (:mod:`.wikitext` with :mod:`.windows` and :mod:`.detokenize`; :mod:`.lambada`)
run against any :class:`~mlm_eval.scoring.scorer.LMScorer`; :mod:`.data_sources` reads their data
(raw files, built-in samples, Hugging Face datasets). :mod:`.wikitext_cli` and :mod:`.lambada_cli`
are the subcommands: each parses its task flags and hands :func:`.runner.run_task` its data
loader and evaluation; :mod:`.results` writes the result record and prints the table.
"""
