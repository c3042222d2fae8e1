"""finetune package."""
