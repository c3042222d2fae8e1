"""BufferPool: freed buffers of the same size are reused, buffers in use never are, and the
bytes held stay within the budget; the legacy reader's joined tensors stay correct with it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pretrain.utils.buffer_pool import BufferPool, pooled_buffers, pooled_empty


def test_a_freed_buffer_of_the_same_size_is_reused() -> None:
    pool = BufferPool(min_bytes=0)
    a = pool.empty((4, 8), torch.float32)
    where = a.data_ptr()
    del a
    b = pool.empty((8, 4), torch.float32)  # same bytes, another shape
    assert b.data_ptr() == where and b.shape == (8, 4) and b.is_contiguous()
    assert (pool.reused, pool.fresh) == (1, 1)
    c = pool.empty((2, 8, 2), torch.bfloat16)  # 64 bytes: another size
    assert c.data_ptr() != where and pool.fresh == 2


def test_a_buffer_still_viewed_is_never_handed_out() -> None:
    pool = BufferPool(min_bytes=0)
    a = pool.empty((16,), torch.float32)
    view = a[3:5]
    del a
    b = pool.empty((16,), torch.float32)
    assert b.data_ptr() != view.data_ptr() - 3 * 4
    b.fill_(1.0)
    c = pool.empty((16,), torch.float32)  # both held buffers in use: a third
    c.fill_(2.0)
    assert torch.equal(b, torch.ones(16)) and pool.reused == 0


def test_held_bytes_stay_within_the_budget_and_the_largest_free_go_first() -> None:
    pool = BufferPool(budget=1000, min_bytes=0)
    for n in (600, 100, 200):  # 900 bytes held, all free after each line
        pool.empty((n // 4,), torch.float32)
    pool.empty((400 // 4,), torch.float32)  # needs 400: the free 600 goes, not the 100 or 200
    assert sorted(s.nbytes() for s in pool._held) == [100, 200, 400]
    keep = [pool.empty((n // 4,), torch.float32) for n in (100, 200, 400)]
    assert pool.reused == 3
    extra = pool.empty((800 // 4,), torch.float32)  # nothing free to drop: made, not held
    assert pool.held_bytes == 700 and extra.numel() == 200 and len(keep) == 3


def test_small_requests_are_plain_allocations() -> None:
    pool = BufferPool()
    pool.empty((10,), torch.float32)
    assert pool.held_bytes == 0 and pool.fresh == 0


def test_default_budget_holds_a_layer_beside_a_larger_embedding() -> None:
    """A Llama-shaped layer's four sizes are all reused per layer beside a larger embedding."""
    pool = BufferPool(min_bytes=0)
    pool.empty((1000,), torch.uint8)  # the embedding
    layer = (150, 100, 400, 200)
    for _ in range(4):
        for n in layer:
            pool.empty((n,), torch.uint8)
    assert pool.reused == 3 * len(layer) and pool.held_bytes <= 2000


def test_default_budget_holds_a_layer_before_any_larger_tensor() -> None:
    """to-hf's order at 3B: layers before the embedding, a layer summing to 2 x its fc1 (QKV,
    projection, fc1, fc2 of hidden 3072, ffn 8192, 8 KV heads). Only the first layer allocates;
    at 1.5 x the largest request fc1 and fc2 evicted each other in every layer."""
    pool = BufferPool(min_bytes=0)
    layer = (30, 18, 96, 48)  # in units of 1 MiB / 1.05: QKV 5/3 h^2, proj h^2, fc1 2 f h, fc2 f h
    for _ in range(5):
        for n in layer:
            pool.empty((n,), torch.uint8)
    assert pool.fresh == len(layer) and pool.reused == 4 * len(layer)
    assert pool.held_bytes == sum(layer) <= 2 * max(layer)


@pytest.mark.parametrize("tp", [2, 4])
def test_legacy_reader_tensors_are_right_with_reused_buffers(tmp_path: Path, tp: int) -> None:
    """Every tensor a consumer keeps stays intact while later ones reuse freed buffers; the
    values equal the source's."""
    from pretrain.checkpoint.legacy.writer import WriteOptions, write_layout
    from pretrain.checkpoint.opener import open_checkpoint
    from pretrain.checkpoint.plan import ModelSpec
    from pretrain.checkpoint.types import DictSource
    from pretrain.parallel.config import ParallelConfig
    from tests.gpt_fixtures import full_weights, tiny_config

    cfg = tiny_config(num_layers=3)
    weights = full_weights(cfg)
    write_layout(DictSource(ModelSpec(kind="gpt", cfg=cfg), weights), tmp_path / "ckpt",
                 ParallelConfig(tp=tp, pp=1), options=WriteOptions(iteration="release"))  # fmt: skip
    reader = open_checkpoint(tmp_path / "ckpt")
    with pooled_buffers(BufferPool(min_bytes=0)) as pool:
        for name in reader.names():  # dropped at once: the next tensor of its size reuses the buffer
            assert torch.equal(reader.tensor(name), weights[name]), name
        assert pool.reused > 0
        kept = {name: reader.tensor(name) for name in reader.names()}  # all alive: none handed out twice
        for name, tensor in kept.items():
            assert torch.equal(tensor, weights[name]), name


def test_pooled_empty_is_plain_outside_a_pool_and_per_thread() -> None:
    import threading

    assert pooled_empty((4,), torch.float32).shape == (4,)
    with pooled_buffers(BufferPool(min_bytes=0)) as pool:
        pooled_empty((4,), torch.float32)
        seen: list[int] = []
        worker = threading.Thread(target=lambda: seen.append(pooled_empty((4,), torch.float32).numel()))
        worker.start()
        worker.join()  # another thread has no active pool: a plain allocation, not this pool's
        assert seen == [4] and pool.fresh == 1
    assert pooled_empty((4,), torch.float32).data_ptr() != 0 and pool.fresh == 1


def test_conversions_with_every_buffer_pooled_equal_those_without(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """from-hf (fused QKV and gate/up, row-parallel shard copies), to-hf, reshard, legacy ->
    torch_dist and torch_dist -> HF (the dcp reader's targets) with every tensor from the pool (tiny tensors included) give the same tensors as
    with plain allocations; the pool did reuse buffers."""
    from safetensors.torch import load_file

    import pretrain.checkpoint.legacy.writer as legacy_writer
    import pretrain.checkpoint.torch_dist.writer as dist_writer
    import pretrain.utils.buffer_pool as bp
    from pretrain.checkpoint.opener import open_checkpoint
    from tests.llama_fixtures import hf_model
    from tools.convert_cli import main

    hf_dir = tmp_path / "hf"
    hf_model("llama3").save_pretrained(str(hf_dir))
    real = bp.pooled_buffers
    pools: list[BufferPool] = []

    def every_tensor_pooled(pool: BufferPool | None = None):  # noqa: ANN202
        pools.append(BufferPool(min_bytes=0))
        return real(pools[-1])

    def convert(tag: str) -> Path:
        root = tmp_path / tag
        steps = [["from-hf", "--load", str(hf_dir), "--save", str(root / "ours"), "--tp", "2", "--pp", "2",
                  "--weights-only"],
                 ["to-hf", "--load", str(root / "ours"), "--save", str(root / "hf"), "--weights-only"],
                 ["reshard", "--load", str(root / "ours"), "--save", str(root / "tp1"), "--target-tp", "1",
                  "--target-pp", "1"],
                 ["reshard", "--load", str(root / "ours"), "--save", str(root / "dist"), "--target-tp", "2",
                  "--target-pp", "1", "--ckpt-format", "torch_dist"],
                 ["to-hf", "--load", str(root / "dist"), "--save", str(root / "hf_from_dist"), "--weights-only"]]  # fmt: skip
        for argv in steps:
            assert main(argv) == 0, argv
        return root

    # the writers cut shards and chunks from the sources' stored blocks (no buffers: shard_views,
    # the torch_dist pieces path); here they join the full tensors, into pooled buffers
    monkeypatch.setattr(legacy_writer, "SHARDS_FROM_PIECES", False)
    monkeypatch.setattr(dist_writer, "CHUNKS_FROM_PIECES", False)
    plain = convert("plain")
    monkeypatch.setattr(bp, "pooled_buffers", every_tensor_pooled)
    pooled = convert("pooled")
    # to-hf, from legacy or torch_dist, writes every tensor of this model from views of the mapped
    # files (row and column blocks: hf_row_select, torch_dist/mapped.py): it needs no buffers at all
    # (the torch_dist save writes its two files in lockstep, two chunks of different tensors at a
    # time: its joins come from the pool, reused or not)
    reused = [p.reused for p in pools]
    assert len(pools) == 5 and reused[0] > 0 and reused[2] > 0 and reused[1] == reused[4] == 0, reused
    assert pools[3].reused + pools[3].fresh > 0
    for ckpt in ("ours", "tp1", "dist"):
        a, b = open_checkpoint(plain / ckpt), open_checkpoint(pooled / ckpt)
        assert list(a.names()) == list(b.names())
        for name in a.names():
            assert torch.equal(a.stored_rows(name), b.stored_rows(name)), (ckpt, name)
    for hf in ("hf", "hf_from_dist"):
        (sa,), (sb,) = (list((d / hf).glob("*.safetensors")) for d in (plain, pooled))
        ta, tb = load_file(sa), load_file(sb)
        assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta), hf


def test_read_only_views_give_contiguous_tensors_back_uncopied() -> None:
    """The weights fingerprint reads a source's tensors where they lie: within
    ``read_only_views`` a contiguous tensor is not copied; a strided one still is; outside, a copy."""
    from pretrain.utils.buffer_pool import pooled_copy, read_only_views

    t = torch.arange(12.0).view(3, 4)
    with read_only_views():
        assert pooled_copy(t) is t
        strided = pooled_copy(t.t())
        assert strided.is_contiguous() and torch.equal(strided, t.t())
    copied = pooled_copy(t)
    assert copied is not t and copied.data_ptr() != t.data_ptr() and torch.equal(copied, t)
