"""lm-evaluation-harness backend ``mlm``: any harness task on any checkpoint, in place.

``mlm_eval.harness.backend`` registers the model name ``mlm`` with the harness's registry when
imported (it imports ``lm_eval``; this package's ``__init__`` does not). The ``mlm-lm-eval``
command (:mod:`mlm_eval.harness.cli`) is the harness's own command line with that backend
registered; the ``lm_eval.models`` entry point lets harness versions that discover plugins find it.
"""
