"""GPT dataset: samples against a brute-force token stream, splits, epochs, cache, determinism, blending."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from pretrain.data.gpt_dataset import (
    BlendedDataset,
    GPTDataset,
    GPTDatasetConfig,
    build_blending_indices,
    build_gpt_datasets,
    collate_samples,
    global_batch_indices,
    parse_data_prefix,
    parse_split,
    split_document_ranges,
)
from pretrain.data.indexed_dataset import IndexedDataset
from pretrain.data.indexed_dataset_builder import IndexedDatasetBuilder
from pretrain.utils.errors import UserError

EOD = 0


def _make_dataset(prefix: Path, n_docs: int, seed: int, max_len: int = 60) -> list[np.ndarray]:
    """Documents of random length (some empty, some longer than a sample), each ending in EOD."""
    rng = np.random.default_rng(seed)
    docs = []
    with IndexedDatasetBuilder(prefix, dtype=np.uint16) as builder:
        for d in range(n_docs):
            n = 0 if d % 17 == 5 else int(rng.integers(1, max_len))
            doc = np.append(rng.integers(1, 1000, n), EOD) if n else np.zeros(0, np.int64)
            # Documents may consist of several sequences (sentences); GPT reads whole documents.
            cut = [n // 2, n + 1 - n // 2] if n > 3 else None
            builder.add_document(doc, cut)
            docs.append(doc)
    return docs


def _reference_samples(ds: GPTDataset, docs: list[np.ndarray]) -> list[np.ndarray]:
    """Brute force: concatenate the documents in document_index order and cut windows of s + 1."""
    stream = np.concatenate([docs[int(d)] for d in ds.document_index]).astype(np.int64)
    s = ds.seq_length
    n = (stream.size - 1) // s
    return [stream[j * s : j * s + s + 1] for j in range(n)]


@pytest.fixture()
def data(tmp_path: Path) -> tuple[Path, list[np.ndarray]]:
    prefix = tmp_path / "data" / "a_text_document"
    return prefix, _make_dataset(prefix, 120, seed=1)


def _config(prefix: Path | list[str], tmp_path: Path, **kw: object) -> GPTDatasetConfig:
    data_prefix = [str(prefix)] if isinstance(prefix, Path) else prefix
    base: dict[str, object] = dict(seq_length=16, data_prefix=data_prefix, split="80,15,5", seed=7)
    base["cache_dir"] = str(tmp_path / "cache")
    base.update(kw)
    return GPTDatasetConfig(**base)  # type: ignore[arg-type]


def test_samples_reconstruct_the_token_stream(tmp_path: Path, data: tuple[Path, list[np.ndarray]]) -> None:
    prefix, docs = data
    cfg = _config(prefix, tmp_path)
    for num_samples in (None, 10, 500, 2000):  # one epoch, part of one, several epochs
        ds = GPTDataset(str(prefix), cfg, num_samples=num_samples)
        ref = _reference_samples(ds, docs)
        assert len(ds) == len(ref)
        if num_samples is not None:
            assert len(ds) >= num_samples
        for j, expected in enumerate(ref):
            np.testing.assert_array_equal(ds.sample_tokens(j), expected)
        assert sorted(int(x) for x in ds.shuffle_index) == list(range(len(ds)))
        for i in range(0, len(ds), 7):
            sample = ds[i]
            tokens = ref[int(ds.shuffle_index[i])]
            assert sample["tokens"].dtype == torch.int64 and sample["labels"].dtype == torch.int64
            assert sample["loss_mask"].dtype == torch.float32
            assert sample["tokens"].tolist() == tokens[:-1].tolist()
            assert sample["labels"].tolist() == tokens[1:].tolist()
            assert sample["position_ids"].tolist() == list(range(16))
            assert sample["loss_mask"].tolist() == [1.0] * 16
        # Every epoch is a fresh permutation of all documents.
        n_docs = len(docs)
        epochs = ds.document_index.reshape(-1, n_docs)
        for e in range(epochs.shape[0]):
            assert sorted(epochs[e].tolist()) == list(range(n_docs))
        if epochs.shape[0] > 1:
            assert not np.array_equal(epochs[0], epochs[1])


def test_eod_mask_loss(tmp_path: Path, data: tuple[Path, list[np.ndarray]]) -> None:
    prefix, _ = data
    ds = GPTDataset(str(prefix), _config(prefix, tmp_path, eod_mask_loss=True, eod_id=EOD))
    batch = collate_samples([ds[i] for i in range(len(ds))])
    assert batch["tokens"].shape == (len(ds), 16)
    assert torch.equal(batch["loss_mask"] == 0, batch["tokens"] == EOD)
    assert bool((batch["tokens"] == EOD).any())
    with pytest.raises(UserError, match="eod"):
        _config(prefix, tmp_path, eod_mask_loss=True)


def test_last_partial_epoch_is_shuffled_separately(
    tmp_path: Path, data: tuple[Path, list[np.ndarray]]
) -> None:
    prefix, _ = data
    one_epoch = len(GPTDataset(str(prefix), _config(prefix, tmp_path)))
    ds = GPTDataset(str(prefix), _config(prefix, tmp_path), num_samples=2 * one_epoch + 3)
    tokens_per_epoch = ds.tokens_per_epoch
    sans_last = (2 * tokens_per_epoch - 1) // 16
    assert ds.document_index.size == 3 * ds.documents.size
    head = ds.shuffle_index[:sans_last]
    assert int(head.max()) < sans_last  # the first two epochs come first, in full
    assert sorted(int(x) for x in ds.shuffle_index[sans_last:]) == list(range(sans_last, len(ds)))


def test_splits_are_disjoint_and_cover_all_documents(
    tmp_path: Path, data: tuple[Path, list[np.ndarray]]
) -> None:
    prefix, docs = data
    assert parse_split("969,30,1") == pytest.approx((0.969, 0.030, 0.001))
    assert parse_split("1/1") == pytest.approx((0.5, 0.5, 0.0))
    assert split_document_ranges("969,30,1", 1000) == [(0, 969), (969, 999), (999, 1000)]
    assert split_document_ranges("80,15,5", 120) == [(0, 96), (96, 114), (114, 120)]
    for split in ("1,1,1", "2,1", "100,0,0", "969,30,1"):
        for n in (0, 1, 2, 7, 100, 12345):
            ranges = split_document_ranges(split, n)
            assert ranges[0][0] == 0 and ranges[-1][1] == n
            assert all(a <= b for a, b in ranges) and all(ranges[i][1] == ranges[i + 1][0] for i in range(2))
    train, valid, test = build_gpt_datasets(_config(prefix, tmp_path), [100, 20, 5])
    assert isinstance(train, GPTDataset) and isinstance(valid, GPTDataset) and isinstance(test, GPTDataset)
    sets = [set(d.documents.tolist()) for d in (train, valid, test)]
    assert not (sets[0] & sets[1]) and not (sets[0] & sets[2]) and not (sets[1] & sets[2])
    assert set.union(*sets) == set(range(len(docs)))
    assert len(train) >= 100 and len(valid) >= 20 and len(test) >= 5
    # Validation samples only contain validation documents' tokens.
    for j in range(len(valid)):
        ref = _reference_samples(valid, docs)
        np.testing.assert_array_equal(valid.sample_tokens(j), ref[j])
    _, v0, _ = build_gpt_datasets(_config(prefix, tmp_path), [100, 0, 5])
    assert v0 is None
    only_train = build_gpt_datasets(_config(prefix, tmp_path, split="100,0,0"), [10, 5, 5])
    assert isinstance(only_train[0], GPTDataset) and only_train[1:] == (None, None)  # as Megatron
    with pytest.raises(UserError, match="the train split .* has no documents, but 10 train samples"):
        build_gpt_datasets(_config(prefix, tmp_path, split="0,1,1"), [10, 5, 5])
    with pytest.raises(UserError, match="--split"):
        _config(prefix, tmp_path, split="a,b")


def test_cache_reuse_and_invalidation(tmp_path: Path, data: tuple[Path, list[np.ndarray]]) -> None:
    prefix, _ = data
    cfg = _config(prefix, tmp_path)
    first = GPTDataset(str(prefix), cfg, num_samples=300)
    assert not first.cache_hit
    files = sorted(os.listdir(tmp_path / "cache"))
    assert len(files) == 4 and all(f.startswith(first.unique_description_hash) for f in files)
    second = GPTDataset(str(prefix), cfg, num_samples=300)
    assert second.cache_hit
    for name in ("document_index", "sample_index", "shuffle_index"):
        np.testing.assert_array_equal(getattr(first, name), getattr(second, name))
    # Any input change gives a different key and a rebuild.
    assert not GPTDataset(str(prefix), _config(prefix, tmp_path, seed=8), num_samples=300).cache_hit
    assert not GPTDataset(str(prefix), _config(prefix, tmp_path, seq_length=15), num_samples=300).cache_hit
    assert not GPTDataset(str(prefix), cfg, num_samples=301).cache_hit
    new_docs = _make_dataset(prefix, 120, seed=2)  # same prefix, new content
    rebuilt = GPTDataset(str(prefix), cfg, num_samples=300)
    assert not rebuilt.cache_hit
    assert rebuilt.unique_description_hash != first.unique_description_hash
    for j, ref in enumerate(_reference_samples(rebuilt, new_docs)):
        np.testing.assert_array_equal(rebuilt.sample_tokens(j), ref)
    # A damaged cache file is rebuilt, not trusted.
    Path(rebuilt.cache_paths["sample_index"]).write_bytes(b"garbage")
    again = GPTDataset(str(prefix), cfg, num_samples=300)
    assert not again.cache_hit
    np.testing.assert_array_equal(again.sample_index, rebuilt.sample_index)
    assert GPTDataset(str(prefix), cfg, num_samples=300).cache_hit
    # No cache dir: nothing on disk.
    nocache = GPTDataset(str(prefix), _config(prefix, tmp_path, cache_dir=None), num_samples=300)
    assert not nocache.cache_hit and nocache.cache_paths == {}
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")]  # no temporaries


def test_deterministic_and_seed_dependent(tmp_path: Path, data: tuple[Path, list[np.ndarray]]) -> None:
    prefix, _ = data
    a = GPTDataset(str(prefix), _config(prefix, tmp_path, cache_dir=None), num_samples=400)
    b = GPTDataset(str(prefix), _config(prefix, tmp_path / "other", cache_dir=None), num_samples=400)
    c = GPTDataset(str(prefix), _config(prefix, tmp_path, cache_dir=None, seed=8), num_samples=400)
    assert [a[i]["tokens"].tolist() for i in range(50)] == [b[i]["tokens"].tolist() for i in range(50)]
    assert [a[i]["tokens"].tolist() for i in range(50)] != [c[i]["tokens"].tolist() for i in range(50)]


def test_global_batches_do_not_depend_on_dp_size(tmp_path: Path, data: tuple[Path, list[np.ndarray]]) -> None:
    prefix, _ = data
    ds = GPTDataset(str(prefix), _config(prefix, tmp_path), num_samples=200)
    global_batch = 8
    for iteration in range(5):
        per_dp = {}
        for dp in (1, 2, 4, 8):
            idx = np.concatenate([global_batch_indices(iteration, global_batch, r, dp) for r in range(dp)])
            per_dp[dp] = torch.stack([ds[int(i)]["tokens"] for i in idx])
            assert idx.tolist() == list(range(iteration * global_batch, (iteration + 1) * global_batch))
        for dp in (2, 4, 8):
            assert torch.equal(per_dp[1], per_dp[dp])
    assert global_batch_indices(3, 8, 1, 2).tolist() == [28, 29, 30, 31]
    with pytest.raises(ValueError, match="not divisible"):
        global_batch_indices(0, 6, 0, 4)
    with pytest.raises(ValueError, match="out of range"):
        global_batch_indices(0, 8, 2, 2)


def test_blending_indices_follow_weights() -> None:
    weights = [0.5, 0.3, 0.2]
    ds_index, ds_sample = build_blending_indices(weights, 10000)
    counts = np.zeros(3, dtype=np.int64)
    for i, d in enumerate(ds_index.tolist()):
        assert ds_sample[i] == counts[d]  # each dataset's samples are taken in order
        counts[d] += 1
        if i >= 100 and i % 97 == 0:  # the greedy rule keeps every prefix close to the weights
            assert np.all(np.abs(counts - np.array(weights) * (i + 1)) <= 1.0)
    assert counts.tolist() == [5000, 3000, 2000]
    # Megatron's greedy rule on a small case.
    assert build_blending_indices([0.5, 0.5], 4)[0].tolist() == [0, 1, 0, 1]
    assert build_blending_indices([0.25, 0.75], 4)[0].tolist() == [1, 0, 1, 1]


def test_blended_dataset(tmp_path: Path) -> None:
    pa, pb = tmp_path / "a", tmp_path / "b"
    docs_a = _make_dataset(pa, 80, seed=3)
    docs_b = _make_dataset(pb, 50, seed=4)
    assert parse_data_prefix(["0.3", str(pa), "0.7", str(pb)]) == [(str(pa), 0.3), (str(pb), 0.7)]
    assert parse_data_prefix([str(pa), str(pb)]) == [(str(pa), None), (str(pb), None)]
    cfg = _config(["0.3", str(pa), "0.7", str(pb)], tmp_path, split="90,10,0")
    train, valid, test = build_gpt_datasets(cfg, [1000, 50, 0])
    assert isinstance(train, BlendedDataset) and isinstance(valid, BlendedDataset) and test is None
    assert len(train) == 1000
    shares = np.bincount(np.asarray(train.dataset_index), minlength=2) / len(train)
    assert shares == pytest.approx([0.3, 0.7], abs=0.002)
    for i in range(0, 1000, 37):
        d, j = train.dataset_of(i)
        component = train.datasets[d]
        assert train[i]["tokens"].tolist() == component[j]["tokens"].tolist()
        ref = _reference_samples(component, docs_a if d == 0 else docs_b)
        assert train[i]["tokens"].tolist() == ref[int(component.shuffle_index[j])][:-1].tolist()
    again, _, _ = build_gpt_datasets(cfg, [1000, 50, 0])
    assert isinstance(again, BlendedDataset) and again.cache_hit
    np.testing.assert_array_equal(again.dataset_index, train.dataset_index)
    # Without weights, datasets are weighted by their tokens in the split.
    unweighted, _, _ = build_gpt_datasets(
        _config([str(pa), str(pb)], tmp_path, split="90,10,0"), [600, 10, 0]
    )
    assert isinstance(unweighted, BlendedDataset)
    tokens = [float(c.tokens_per_epoch) for c in unweighted.datasets]
    assert unweighted.weights == pytest.approx([t / sum(tokens) for t in tokens])
    with pytest.raises(UserError, match="--data-path"):
        parse_data_prefix(["0.5", str(pa), "0.5"])


def test_too_small_split_is_a_clear_error(tmp_path: Path) -> None:
    prefix = tmp_path / "tiny"
    with IndexedDatasetBuilder(prefix, dtype=np.uint16) as builder:
        builder.add_document([1, 2, 3])
    with pytest.raises(UserError, match=r"tiny\.idx: the train split has 1 documents and 3 tokens"):
        GPTDataset(str(prefix), _config(prefix, tmp_path))
    ds = GPTDataset(str(prefix), _config(prefix, tmp_path), num_samples=4)  # enough epochs make it work
    assert len(ds) >= 4
    assert IndexedDataset(prefix).num_tokens == 3
