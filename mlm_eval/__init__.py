"""mlm_eval package."""
