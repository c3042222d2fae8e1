"""Tensor-parallel building blocks (paper section 3): mappings, layers, cross-entropy, RNG."""
