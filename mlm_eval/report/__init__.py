"""``mlm-eval report``: result files into one ranked leaderboard (terminal, Markdown, CSV, JSON, HTML).

Layered bottom-up, each module importing only those before it: :mod:`.records` (the record types
and unit rules), :mod:`.harness_results` (lm-evaluation-harness files as records),
:mod:`.collect` (our records, and the walk over result directories), :mod:`.paper_reference`
(the paper's published rows), :mod:`.columns` (task columns, number formatting), :mod:`.table`
(the ``Leaderboard``), :mod:`.text` (the texts every output shares), :mod:`.plots` (figures),
:mod:`.html` (the self-contained page), :mod:`.render` (Markdown, CSV, JSON, and writing all
four), :mod:`.cli` (the subcommand and its terminal table).
"""
