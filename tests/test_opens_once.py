"""Every command opens each checkpoint file set once and each tokenizer directory once.

Spies sit on the lowest open functions: the load of one legacy rank file, of a ``torch_dist``
``.metadata`` and ``common.pt``, and of a tokenizer directory. The legacy checkpoint is an upstream
one whose ``args`` record no vocabulary size, so the tokenizer of ``--tokenizer-dir`` tells it (a
``with_vocab`` view, where the checkpoint used to be opened a second time).
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mlm_eval.cli import main as eval_main
from mlm_eval.generation.cli import main as generate_main
from tools.convert_cli import main as convert_main

WIKI = ["--data", "builtin:wikitext_sample.tokens", "--seq-length", "32", "--overlap", "8", "--no-progress"]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny GPT-2 BPE directory; an upstream tp2 legacy checkpoint whose args give no vocabulary
    size; the same as our ``torch_dist`` checkpoint carrying the tokenizer."""
    from pretrain.tokenizer.train_tiny import train_tiny_gpt2_bpe
    from tests.convert_fixtures import rewrite_upstream, upstream_args, write_ours
    from tests.gpt_fixtures import full_weights, tiny_config

    root = tmp_path_factory.mktemp("opens")
    tok = train_tiny_gpt2_bpe(root / "tok", vocab_size=300)
    vocab = len(json.loads((tok / "vocab.json").read_text()))
    cfg = tiny_config(vocab_size=vocab, max_position_embeddings=64)
    legacy = write_ours(root / "legacy", cfg, full_weights(cfg), tp=2, pp=1)
    args = upstream_args(cfg, tp=2, pp=1)
    args.padded_vocab_size = 512
    rewrite_upstream(legacy, cfg, version=3.0, era="legacy", args=args)
    assert convert_main(["reshard", "--load", str(legacy), "--save", str(root / "dist"), "--target-tp", "1",
                         "--target-pp", "1", "--ckpt-format", "torch_dist", "--tokenizer-dir", str(tok)]) == 0  # fmt: skip
    return {"tok": tok, "legacy": legacy, "dist": root / "dist"}


Spy = Callable[[list[str]], Counter[str]]


@pytest.fixture
def opens(monkeypatch: pytest.MonkeyPatch) -> Spy:
    """``opens(argv)`` runs a command line and counts the opens of every file and directory."""
    import mlm_eval.scoring.megatron as scorer
    import pretrain.checkpoint.legacy.reader as legacy
    import pretrain.checkpoint.torch_dist.dcp_meta as dcp_meta
    import pretrain.checkpoint.torch_dist.reader as dist
    import pretrain.tokenizer.loader as loader

    counts: Counter[str] = Counter()

    def spy(module: Any, name: str, what: str) -> None:
        real = getattr(module, name)

        def counted(path: Any, *args: Any, **kwargs: Any) -> Any:
            counts[f"{what} {Path(path).resolve()}"] += 1
            return real(path, *args, **kwargs)

        monkeypatch.setattr(module, name, counted)

    spy(legacy, "load_untrusted", "rank file")
    spy(dist, "load_untrusted", "common.pt")
    spy(dcp_meta, "read_dcp_metadata", ".metadata")
    spy(loader, "load_tokenizer_dir", "tokenizer")
    spy(scorer, "load_tokenizer_dir", "tokenizer")

    def run(argv: list[str]) -> Counter[str]:
        counts.clear()
        main = {"eval": eval_main, "generate": generate_main}.get(argv[0], convert_main)
        assert main(argv[1:] if main is not convert_main else argv) == 0
        return Counter(counts)

    return run


def _once(counts: Counter[str], *kinds: str) -> None:
    assert counts and all(n == 1 for n in counts.values()), dict(counts)
    assert {k.split(" /")[0] for k in counts} >= set(kinds), dict(counts)


@pytest.mark.parametrize("fmt", ["legacy", "dist"])
def test_every_command_opens_each_checkpoint_and_tokenizer_once(
    fmt: str, ckpts: dict[str, Path], opens: Spy, tmp_path: Path
) -> None:
    ck, tok = str(ckpts[fmt]), str(ckpts["tok"])
    kinds = ("rank file",) if fmt == "legacy" else (".metadata", "common.pt")
    flag = ["--tokenizer-dir", tok]
    _once(opens(["inspect", ck, "--json", *flag]), *kinds, "tokenizer")
    _once(opens(["reshard", "--load", ck, "--save", str(tmp_path / "r"), "--target-tp", "1", "--target-pp", "1",
                 *flag]), *kinds, "tokenizer")  # fmt: skip
    _once(opens(["to-hf", "--load", ck, "--save", str(tmp_path / "hf"), *flag]), *kinds, "tokenizer")
    _once(opens(["eval", "wikitext103", "--ckpt", ck, *flag, *WIKI, "--out", str(tmp_path / "w.json")]),
          *kinds, "tokenizer")  # fmt: skip
    _once(opens(["generate", "--ckpt", ck, *flag, "--prompt", "The", "--max-new-tokens", "2", "--json"]),
          *kinds, "tokenizer")  # fmt: skip
    shutil.rmtree(tmp_path / "hf")


@pytest.mark.parametrize("fmt", ["legacy", "dist"])
def test_with_vocab_is_the_reopened_checkpoint(fmt: str, ckpts: dict[str, Path]) -> None:
    """A reader's ``with_vocab(n)`` view equals the checkpoint opened with that size, and a size the
    checkpoint contradicts is refused with the same line."""
    import torch

    from pretrain.checkpoint.opener import open_checkpoint
    from pretrain.utils.errors import UserError

    ck, what = ckpts[fmt], "--tokenizer-dir T"
    n = len(json.loads((ckpts["tok"] / "vocab.json").read_text()))
    reader = open_checkpoint(ck)
    assert reader.info.vocab_known == (fmt == "dist")  # upstream args record no vocabulary size
    view, reopened = (
        reader.with_vocab(n, source=what),
        open_checkpoint(ck, tokenizer_size=n, tokenizer_source=what),
    )
    assert view.spec == reopened.spec and view.info == reopened.info and view.info.vocab_known
    assert all(torch.equal(view.tensor(k), reopened.tensor(k)) for k in reopened.names())
    with pytest.raises(UserError) as by_view:
        reader.with_vocab(n + 1000, source=what)
    with pytest.raises(UserError) as by_open:
        open_checkpoint(ck, tokenizer_size=n + 1000, tokenizer_source=what)
    assert str(by_view.value) == str(by_open.value)
