"""``python -m mlm_eval.harness.tasks``: print the tasks directory (for ``--include_path``)."""

from mlm_eval.harness.tasks import TASKS_DIR

print(TASKS_DIR)
