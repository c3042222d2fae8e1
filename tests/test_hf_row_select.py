"""to-hf writes HF tensors that are whole rows of one checkpoint tensor from the checkpoint's row
blocks, and tensors passed through unchanged from its column blocks (:mod:`tools.hf_row_select`),
byte for byte the files the joined-and-converted path writes.

The probes recognise a row selection (the family mappings' QKV split with GQA, SwiGLU halves, the
vocabulary's rows) or a pass-through (``o_proj``, ``down_proj``) and nothing else: a transpose, a
cast, arithmetic or a reshape of the rows' contents leaves the source to the ordinary path.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import tools.hf_io
import tools.hf_row_select
from pretrain.checkpoint.types import ColumnPieces, RowPieces
from pretrain.models.families.llama import split_qkv
from pretrain.utils.gathered_write import write_gathered
from tests.convert_fixtures import write_ours
from tests.gpt_fixtures import full_weights, tiny_config
from tools.convert_cli import main
from tools.hf_plan import Planned
from tools.hf_row_select import row_selected, unchanged
from tools.hf_shards import ShardWriter

os.environ["HF_HUB_OFFLINE"] = "1"
LLAMA = dict(normalization="RMSNorm", swiglu=True, position_embedding_type="rope", add_bias_linear=False)


def _pieces(full: torch.Tensor, rows: list[int]) -> RowPieces:
    return RowPieces(tuple(full.split(rows)))


def _joined(pieces: RowPieces) -> torch.Tensor:
    return torch.cat(pieces.parts)


def test_a_gqa_qkv_split_is_rows_of_the_blocks_it_came_from() -> None:
    groups, head_dim, hidden = 2, 4, 6
    qkv = torch.randn(groups * (3 + 2) * head_dim, hidden)  # 3 query heads per group
    pieces = _pieces(qkv, [20, 20])  # the two tensor-parallel ranks' blocks (a group each)

    def run(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        q, k, v = split_qkv(tensors["qkv"], groups=groups, head_dim=head_dim)
        return {"q": q, "k": k, "v": v}

    want = run({"qkv": qkv})
    outputs = [Planned(n, qkv.dtype, tuple(t.shape)) for n, t in want.items()]
    got = row_selected(run, "qkv", pieces, outputs)
    assert got is not None
    for name, t in want.items():
        assert torch.equal(_joined(got[name]), t)
        assert all(p.data_ptr() >= qkv.data_ptr() for p in got[name].parts)  # views, not copies
    assert len(got["q"].parts) == 2 and len(got["k"].parts) == 2  # one run per group


@pytest.mark.parametrize(
    "mapping",
    [
        lambda t: t.t().contiguous(),  # a transpose (GPT-2's Conv1D)
        lambda t: t + 1,  # arithmetic (a stored norm offset)
        lambda t: (t.shape[0] - 1) - t.flip(0),  # arithmetic that maps the index probe to itself
        lambda t: t.to(torch.float32),  # a cast: the bytes would not be the source's
        lambda t: t[:, :2],  # a cut of the rows' contents
    ],
)
def test_anything_but_a_row_selection_is_left_to_the_joined_path(mapping) -> None:
    src = torch.randn(8, 4, dtype=torch.float64)
    want = mapping(src)
    planned = [Planned("out", want.dtype, tuple(want.shape))]
    assert row_selected(lambda d: {"out": mapping(d["w"])}, "w", _pieces(src, [4, 4]), planned) is None


def test_a_pass_through_is_recognised_from_a_probe_never_written() -> None:
    pieces = ColumnPieces((torch.randn(6, 3, dtype=torch.bfloat16), torch.randn(6, 5, dtype=torch.bfloat16)))
    planned = [Planned("out", torch.bfloat16, (6, 8))]
    same: list[Callable[[torch.Tensor], torch.Tensor]] = [
        lambda t: t, lambda t: t.contiguous(), lambda t: t.reshape(6, 8), lambda t: t.t().t(),
    ]  # fmt: skip
    for mapping in same:

        def run(
            d: dict[str, torch.Tensor], f: Callable[[torch.Tensor], torch.Tensor] = mapping
        ) -> dict[str, torch.Tensor]:
            return {"out": f(d["w"])}

        assert unchanged(run, "w", pieces, planned) == "out"


@pytest.mark.parametrize(
    "mapping",
    [
        lambda t: t.clone(),  # a copy: the probe's values are not the source's
        lambda t: t.contiguous().mul_(2),  # arithmetic on a copy
        lambda t: t.mul_(2),  # in place: the probe's version counter moves
        lambda t: (t[:, :4].zero_(), t)[1],  # in place through a view
        lambda t: t + 0,
        lambda t: t.to(torch.float32),  # a cast
        lambda t: t.t(),  # a transpose (GPT-2's Conv1D) has other strides
        lambda t: t[1:],  # a cut
    ],
)
def test_anything_but_a_pass_through_is_left_to_the_joined_path(mapping) -> None:
    pieces = ColumnPieces((torch.randn(6, 3, dtype=torch.bfloat16), torch.randn(6, 5, dtype=torch.bfloat16)))
    planned = [Planned("out", torch.bfloat16, (6, 8))]
    assert unchanged(lambda d: {"out": mapping(d["w"])}, "w", pieces, planned) is None
    two = [*planned, Planned("other", torch.bfloat16, (6, 8))]  # one output alone, not several
    assert unchanged(lambda d: {"out": d["w"], "other": d["w"]}, "w", pieces, two) is None


def test_column_pieces_are_written_as_the_joined_tensor(tmp_path: Path) -> None:
    """Gathered rows (2 x 700 > IOV_MAX chunks, odd widths) are the joined tensor's bytes."""
    parts = (torch.randn(700, 3, dtype=torch.bfloat16), torch.randn(700, 5, dtype=torch.bfloat16))
    for name, tensor in (("cols", ColumnPieces(parts)), ("joined", torch.cat(parts, dim=1))):
        writer = ShardWriter(tmp_path / name, max_shard_size=1 << 30)
        (tmp_path / name).mkdir()
        writer.add("w", tensor)
        writer.add("n", torch.arange(5, dtype=torch.float32))
        writer.close()
    assert (tmp_path / "cols" / "model.safetensors").read_bytes() == (
        tmp_path / "joined" / "model.safetensors"
    ).read_bytes()


@pytest.mark.parametrize("offset", [None, 5])
def test_short_gathered_writes_are_completed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, offset: int | None
) -> None:
    """``os.writev``/``os.pwritev`` may write less than asked (a signal, over 2 GiB): the rest
    follows in order, at the file position or from ``offset`` on (the bytes before it kept)."""
    real_writev, real_pwritev = os.writev, os.pwritev
    monkeypatch.setattr(os, "writev", lambda fd, bufs: real_writev(fd, [bufs[0][: len(bufs[0]) // 2]]))
    monkeypatch.setattr(
        os, "pwritev", lambda fd, bufs, at: real_pwritev(fd, [bufs[0][: len(bufs[0]) // 2]], at)
    )
    chunks = [memoryview(bytes(j % 251 for j in range(i, i + 7))) for i in range(0, 3000, 7)]
    (tmp_path / "f").write_bytes(b"head!")
    with open(tmp_path / "f", "r+b", buffering=0) as fh:
        fh.seek(0, os.SEEK_END)
        write_gathered(fh.fileno(), chunks, offset)
    assert (tmp_path / "f").read_bytes() == b"head!" + b"".join(bytes(c) for c in chunks)


def _legacy(tmp_path: Path, tp: int, pp: int, **overrides: object) -> Path:
    cfg = tiny_config(num_layers=4, **overrides)
    return write_ours(tmp_path / "ck", cfg, full_weights(cfg), tp=tp, pp=pp)


def _made_or_not(monkeypatch: pytest.MonkeyPatch, name: str) -> list[bool]:
    """Whether each call of ``tools.hf_row_select.<name>`` found its rows or pass-through."""
    seen: list[bool] = []
    real = getattr(tools.hf_row_select, name)

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        made = real(*args, **kwargs)
        seen.append(made is not None)
        return made

    monkeypatch.setattr(tools.hf_row_select, name, counted)
    return seen


@pytest.mark.parametrize(
    ("overrides", "rows_expected"),
    [
        (dict(LLAMA, num_query_groups=2, num_attention_heads=8), True),  # GQA QKV, SwiGLU fc1
        (dict(LLAMA, untie_embeddings_and_output_weights=True), True),
        ({}, False),  # GPT-2: Conv1D weights are transposed; only the embeddings are rows
    ],
)
def test_to_hf_from_row_blocks_is_byte_identical(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overrides: dict[str, object], rows_expected: bool
) -> None:
    ck = _legacy(tmp_path, tp=2, pp=2, **overrides)
    calls = _made_or_not(monkeypatch, "row_selected")
    passed = _made_or_not(monkeypatch, "unchanged")
    outs = {}
    for rows in (True, False):
        monkeypatch.setattr(tools.hf_io, "ROW_PIECES", rows)
        outs[rows] = tmp_path / f"hf_rows_{rows}"
        argv = [
            "to-hf",
            "--weights-only",
            "--vocab-size",
            "1003",
            "--load",
            str(ck),
            "--save",
            str(outs[rows]),
        ]
        assert main(argv) == 0
    files = sorted(p.name for p in outs[True].iterdir())
    assert files == sorted(p.name for p in outs[False].iterdir()) and any(
        f.endswith(".safetensors") for f in files
    )
    for name in files:
        assert (outs[True] / name).read_bytes() == (outs[False] / name).read_bytes(), name
    if rows_expected:
        assert sum(calls) >= 2 * 4  # QKV and fc1 of every layer at least
        assert sum(passed) == 2 * 4  # o_proj and down_proj of every layer, from their column blocks
    else:
        assert not any(passed)  # GPT-2's row-parallel weights are transposed for Conv1D
    assert any(calls)  # the word embeddings' vocabulary rows, in every family


@pytest.mark.parametrize(("widths", "stage_bytes"), [((5, 7), 200), ((3,), 64), ((40, 40), 1 << 20)])
def test_column_blocks_are_staged_a_few_rows_at_a_time_or_written_where_they_lie(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, widths: tuple[int, ...], stage_bytes: int
) -> None:
    """Short rows are joined into one reused buffer a few rows at a time (each view written before
    the next is made: with a 200-byte stage, 29 rows take many refills); rows of 64 KB or more are
    gathered where they lie. Either way the file holds ``torch.cat(parts, dim=1)``, at an offset too."""
    import pretrain.utils.gathered_write as gw

    monkeypatch.setattr(gw, "_STAGE_BYTES", stage_bytes)
    monkeypatch.setattr(gw, "_STAGE_BELOW", 64 if widths == (40, 40) else 1 << 16)
    gen = torch.Generator().manual_seed(5)
    parts = [torch.randn(29, w, generator=gen).bfloat16() for w in widths]
    chunks = gw.column_chunks(parts)
    assert isinstance(chunks, list) == (widths == (40, 40))  # 80-byte rows over a 64-byte threshold
    path = tmp_path / "out"
    path.write_bytes(b"x" * 10)
    with open(path, "r+b") as fh:
        gw.write_gathered(fh.fileno(), chunks, 10)
    want = torch.cat(parts, dim=1).view(torch.uint8).numpy().tobytes()
    assert path.read_bytes() == b"x" * 10 + want


def test_a_thread_keeps_its_staging_buffer_and_two_stagings_at_once_do_not_share_it() -> None:
    """Staging reuses the thread's buffer from one tensor to the next (a fresh one costs the
    kernel's zeroing); a second staging started while one is under way gets its own, so both
    streams still hold their tensors' bytes."""
    import pretrain.utils.gathered_write as gw

    gen = torch.Generator().manual_seed(6)
    a = [torch.randn(300, w, generator=gen).bfloat16() for w in (5, 7)]
    b = [torch.randn(300, w, generator=gen).bfloat16() for w in (3, 9)]

    one = gw._staged(a, 300, 12, step=64)
    two = gw._staged(b, 300, 12, step=64)
    got_a, got_b = b"", b""
    for x, y in zip(one, two, strict=True):  # interleaved in one thread
        got_a, got_b = got_a + bytes(x), got_b + bytes(y)
    assert got_a == torch.cat(a, dim=1).view(torch.uint8).numpy().tobytes()
    assert got_b == torch.cat(b, dim=1).view(torch.uint8).numpy().tobytes()
    held = gw._stages.free
    assert held is not None
    for parts in (a, b):  # one after the other: the same buffer
        for view in gw.column_chunks(parts):
            assert torch.frombuffer(view, dtype=torch.uint8).data_ptr() == held.data_ptr()
