"""Models: the transformer shared by GPT and BERT, and their heads."""
