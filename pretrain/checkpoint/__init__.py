"""Megatron-layout checkpoints (legacy ``torch`` format): paths, safe loading, save/load."""
