"""Data: Megatron-compatible indexed datasets, GPT samples (splits, epochs, blending), the demo corpus.

* :mod:`pretrain.data.indexed_dataset` -- the ``.bin``/``.idx`` format and its reader;
  :mod:`pretrain.data.indexed_dataset_builder` -- the atomic builder and merging.
* :mod:`pretrain.data.gpt_dataset` -- :class:`GPTDatasetConfig`, :func:`build_gpt_datasets`,
  :class:`GPTDataset`, :func:`global_batch_indices`; :mod:`pretrain.data.sample_index` (the index
  maps), :mod:`pretrain.data.blending` (:class:`BlendedDataset`), :mod:`pretrain.data.index_cache`.
* :func:`builtin_corpus_path` -- the built-in JSON-lines corpus for the demo.

Names are imported lazily, so ``import pretrain.data.indexed_dataset`` does not pull in torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "IndexedDataset": "pretrain.data.indexed_dataset",
    "IndexedDatasetBuilder": "pretrain.data.indexed_dataset_builder",
    "merge_datasets": "pretrain.data.indexed_dataset_builder",
    "optimal_dtype": "pretrain.data.indexed_dataset",
    "GPTDatasetConfig": "pretrain.data.gpt_dataset",
    "GPTDataset": "pretrain.data.gpt_dataset",
    "BlendedDataset": "pretrain.data.blending",
    "build_gpt_datasets": "pretrain.data.gpt_dataset",
    "global_batch_indices": "pretrain.data.gpt_dataset",
    "collate_samples": "pretrain.data.gpt_dataset",
    "builtin_corpus_path": "pretrain.data.builtin",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pretrain.data' has no attribute {name!r}")
