"""megatron-core's ``torch_dist`` checkpoint format (PyTorch distributed checkpoint).

:mod:`.reader` (canonical tensors from ``.metadata`` + ``.distcp``), :mod:`.writer` (streaming
writer), :mod:`.optimizer` (its optimizer state), :mod:`.dcp_meta` / :mod:`.dcp_meta_write` (the
``.metadata`` pickle read and written without importing dcp), :mod:`.distcp_writer` (the data
files), :mod:`.dcp_failures` (dcp errors as ours, where dcp itself still reads).
"""
