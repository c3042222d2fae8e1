"""The training loop, its configuration, task plug-ins (GPT, BERT, finetuning) and the CLI."""
