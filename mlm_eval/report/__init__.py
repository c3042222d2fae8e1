"""``mlm-eval report``: result files into one ranked leaderboard (terminal, Markdown, CSV, JSON, HTML).

Layered bottom-up: :mod:`.collect` reads and validates our result records into ``RunRecord`` s
(:mod:`.harness_results` does the same for lm-evaluation-harness files), :mod:`.paper_reference`
holds the paper's published rows, :mod:`.columns` the task columns and number formatting,
:mod:`.table` builds the ``Leaderboard``, :mod:`.render` writes it (Markdown, CSV, JSON),
:mod:`.plots` draws its figures and :mod:`.html` the self-contained page; :mod:`.cli` is the
subcommand.
"""
