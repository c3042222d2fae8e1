"""megatron-core's ``torch_dist`` checkpoint format (PyTorch distributed checkpoint).

:mod:`.reader` (canonical tensors from ``.metadata`` + ``.distcp``), :mod:`.writer` (streaming
writer), :mod:`.optimizer` (its optimizer state), :mod:`.dcp_failures` (dcp errors as ours).
"""
