"""Evaluation of mlm-toolkit models (imports :mod:`pretrain`, never the reverse).

- :mod:`mlm_eval.cli`: the ``mlm-eval`` command (subcommands imported on demand).
- :mod:`mlm_eval.scoring`: the scorer interface and the scorers over HF models and our checkpoints.
- :mod:`mlm_eval.tasks`: WikiText-103 and LAMBADA zero-shot evaluation and their data.
- :mod:`mlm_eval.contamination`: n-gram overlap of eval data with training corpora.
- :mod:`mlm_eval.report`: the leaderboard of result files.
- :mod:`mlm_eval.generation`: ``mlm-generate``.
- :mod:`mlm_eval.harness`: the lm-evaluation-harness backend ``mlm`` and its sample tasks.
- :mod:`mlm_eval.builtin`: small built-in sample data.
"""
