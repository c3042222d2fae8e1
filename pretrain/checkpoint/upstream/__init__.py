"""Upstream Megatron-LM checkpoints read into ours: parameter names and QKV orders
(:mod:`.names`), model kind and config from ``args`` (:mod:`.args`, :mod:`.args_semantics`) and the
position-keyed optimizer state of legacy files (:mod:`.optimizer`).
"""
