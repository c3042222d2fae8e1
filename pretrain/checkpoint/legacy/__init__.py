"""Megatron's legacy ``torch`` checkpoint format: one ``model_optim_rng.pt`` per TP/PP rank.

:mod:`.layout` (paths and names), :mod:`.reader` (canonical tensors on demand), :mod:`.writer`
(canonical tensors to any TP/PP/VP layout), :mod:`.io` (per-rank save/load during training),
:mod:`.module_names` (``mcore`` or ``legacy`` names in the file), :mod:`.pages` (give back mmap'd
pages).
"""
