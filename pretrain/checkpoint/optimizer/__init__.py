"""Optimizer state as canonical full tensors (:mod:`.state`) and its reshard with the model
(:mod:`.reshard`).
"""
