"""Blending several datasets by weight with Megatron's greedy rule: sample ``i`` comes from the
dataset whose share so far lags its weight the most."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from pretrain.data.index_cache import MAPS_VERSION, IndexCache


class SampleDataset(Protocol):
    """What blending needs of a component dataset (a :class:`~pretrain.data.gpt_dataset.GPTDataset`)."""

    unique_description_hash: str

    def __len__(self) -> int: ...

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]: ...


BLEND_MARGIN = 1.005  # Megatron builds 0.5% more samples per blended dataset than the weights ask for


def build_blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's greedy blending: sample ``i`` comes from the dataset ``d`` maximising
    ``w_d * max(i, 1) - count_d`` (ties: the lowest ``d``). Returns (dataset_index int16,
    dataset_sample_index int64)."""
    w = [float(x) for x in weights]
    n = len(w)
    if n > np.iinfo(np.int16).max:
        raise ValueError("too many datasets to blend")
    counts = [0] * n
    ds_index = np.empty(size, dtype=np.int16)
    ds_sample = np.empty(size, dtype=np.int64)
    ds_list = [0] * size
    sample_list = [0] * size
    rng_n = range(1, n)
    for i in range(size):
        x = float(max(i, 1))
        best = 0
        best_err = w[0] * x - counts[0]
        for d in rng_n:
            err = w[d] * x - counts[d]
            if err > best_err:
                best, best_err = d, err
        ds_list[i] = best
        sample_list[i] = counts[best]
        counts[best] += 1
    ds_index[:] = ds_list
    ds_sample[:] = sample_list
    return ds_index, ds_sample


class BlendedDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """``size`` samples drawn from ``datasets`` in proportion to ``weights`` (normalised)."""

    def __init__(
        self,
        datasets: Sequence[SampleDataset],
        weights: Sequence[float],
        size: int,
        cache_dir: str | None,
        *,
        split: str = "train",
    ) -> None:
        if len(datasets) != len(weights) or not datasets:
            raise ValueError("need one weight per dataset")
        total = float(sum(weights))
        self.datasets = list(datasets)
        self.weights = [float(w) / total for w in weights]
        self.size = int(size)
        self.split = split
        desc = {
            "class": "BlendedDataset",
            "version": MAPS_VERSION,
            "datasets": [d.unique_description_hash for d in self.datasets],
            "weights": self.weights,
            "size": self.size,
            "split": split,
        }
        cache = IndexCache(
            cache_dir, "BlendedDataset", split, desc, ("dataset_index", "dataset_sample_index")
        )
        loaded = cache.load()
        self.cache_hit = loaded is not None
        if loaded is None:
            ds_index, ds_sample = build_blending_indices(self.weights, self.size)
            loaded = {"dataset_index": ds_index, "dataset_sample_index": ds_sample}
            cache.save(loaded)
        self.cache_paths = dict(cache.paths)
        self.dataset_index = loaded["dataset_index"]
        self.dataset_sample_index = loaded["dataset_sample_index"]

    def __len__(self) -> int:
        return self.size

    def dataset_of(self, idx: int) -> tuple[int, int]:
        """(dataset number, sample number in it) of blended sample ``idx``."""
        d = int(self.dataset_index[idx])
        return d, int(self.dataset_sample_index[idx]) % len(self.datasets[d])

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        i = int(idx)
        if not 0 <= i < self.size:
            raise IndexError(f"sample {idx} out of range for {self.size} blended samples ({self.split})")
        d, j = self.dataset_of(i)
        return self.datasets[d][j]
