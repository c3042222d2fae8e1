"""``python -m mlm_eval.harness ...`` = ``mlm-lm-eval ...`` (for ``torchrun -m``)."""

import sys

from mlm_eval.harness.cli import main

sys.exit(main())
