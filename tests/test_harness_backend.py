"""The ``mlm`` lm-evaluation-harness backend: requests as rows, batch invariance, parity with ``--model hf``."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from mlm_eval.builtin import builtin_path
from mlm_eval.harness.requests import deal, length_order, loglikelihood_row, rolling_rows
from mlm_eval.scoring.scorer import IGNORE

lm_eval = pytest.importorskip("lm_eval")


def test_loglikelihood_row_is_hflm_window() -> None:
    inputs, targets = loglikelihood_row([1, 2, 3], [4, 5], max_length=8)
    assert inputs == [1, 2, 3, 4] and targets == [IGNORE, IGNORE, 4, 5]
    # Too long: cut on the left to max_length inputs, the continuation always scored.
    inputs, targets = loglikelihood_row(list(range(10, 20)), [4, 5], max_length=4)
    assert inputs == [17, 18, 19, 4] and targets == [IGNORE, IGNORE, 4, 5]


def test_rolling_rows_score_every_token_once() -> None:
    tokens = list(range(100, 123))
    rows = rolling_rows(tokens, prefix_token=7, max_length=8)
    scored = [t for _, tgt in rows for t in tgt if t != IGNORE]
    assert scored == tokens
    assert rows[0][0][0] == 7 and all(len(inp) <= 8 for inp, _ in rows)
    assert all(len(inp) == len(tgt) for inp, tgt in rows)


def test_replicas_share_rows_exactly_once() -> None:
    order = length_order([3, 9, 1, 9, 4, 7, 2])
    assert order[:3] == [1, 3, 5]  # longest first, ties by index
    shares = [deal(order, 3, d) for d in range(3)]
    assert sorted(i for s in shares for i in s) == list(range(7))


# --- a tiny in-memory model and its tokenizer --------------------------------------------------


@pytest.fixture(scope="module")
def tiny_engine_parts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    from pretrain.models.gpt import GPTModel
    from pretrain.models.sharding import load_full_state_dict
    from pretrain.parallel.state import ParallelState
    from pretrain.tokenizer.factory import TokenizerConfig, build_tokenizer
    from pretrain.tokenizer.train_tiny import train_tiny_gpt2_bpe
    from tests.gpt_fixtures import full_weights, tiny_config

    tok_dir = train_tiny_gpt2_bpe(tmp_path_factory.mktemp("tok"))
    tokenizer = build_tokenizer(TokenizerConfig(tokenizer_type="GPT2BPETokenizer",
                                                vocab_file=str(tok_dir / "vocab.json"),
                                                merge_file=str(tok_dir / "merges.txt")))  # fmt: skip
    cfg = tiny_config(vocab_size=tokenizer.vocab_size, max_position_embeddings=48, num_attention_heads=4)
    model = GPTModel(cfg, ParallelState.single())
    load_full_state_dict(model, full_weights(cfg))
    return model.eval(), tokenizer


def make_lm(parts: tuple[Any, Any], batch_size: int, **kwargs: Any) -> Any:
    from mlm_eval.harness.backend import MLMHarnessLM
    from mlm_eval.harness.engine import BatchInvariantScorer, HarnessEngine

    model, tokenizer = parts
    engine = HarnessEngine(model, BatchInvariantScorer(model), tokenizer,
                           batch_size=batch_size, progress=False)  # fmt: skip
    return MLMHarnessLM(engine=engine, **kwargs)


class _Req:
    def __init__(self, *args: Any) -> None:
        self.args = args


def _lambada_pairs(n: int) -> list[tuple[str, str]]:
    texts = [json.loads(x)["text"] for x in builtin_path("lambada_sample.jsonl").read_text().splitlines()]
    pairs = []
    for i, text in enumerate(texts[:n]):
        cut = len(text) // (2 + i % 3)  # contexts and continuations of many lengths
        pairs.append((text[:cut], text[cut : cut + 5 + 7 * (i % 4)]))
    return pairs


def test_scores_do_not_depend_on_batch_size_or_order(tiny_engine_parts: tuple[Any, Any]) -> None:
    pairs = _lambada_pairs(23)
    docs = [_Req(a + b) for a, b in pairs[:6]]
    results = {}
    for bs in (1, 7):
        lm = make_lm(tiny_engine_parts, bs)
        ll = lm.loglikelihood([_Req(*p) for p in pairs], disable_tqdm=True)
        rolling = lm.loglikelihood_rolling(docs, disable_tqdm=True)
        rev = lm.loglikelihood([_Req(*p) for p in reversed(pairs)], disable_tqdm=True)[::-1]
        results[bs] = (ll, rolling, rev)
    ll1, roll1, rev1 = results[1]
    assert len({round(x, 3) for x, _ in ll1}) > 10  # many different scores
    assert results[7] == results[1]  # bitwise: batch composition and order change nothing
    assert rev1 == ll1


def test_loglikelihood_equals_plain_forward(tiny_engine_parts: tuple[Any, Any]) -> None:
    model, tokenizer = tiny_engine_parts
    lm = make_lm(tiny_engine_parts, 4)
    context, cont = "the cat sat on the", " mat"
    ((got, greedy),) = lm.loglikelihood([_Req(context, cont)], disable_tqdm=True)
    ctx_ids, all_ids = tokenizer.tokenize(context), tokenizer.tokenize(context + cont)
    with torch.no_grad():
        logits = model.full_logits(model(torch.tensor([all_ids[:-1]])))[0].double()
    logp = torch.log_softmax(logits, dim=-1)
    n = len(all_ids) - len(ctx_ids)
    want = sum(float(logp[len(all_ids) - 1 - n + j, all_ids[len(ctx_ids) + j]]) for j in range(n))
    assert got == pytest.approx(want, rel=1e-6)  # fp32 logits (GEMM shapes differ)
    assert greedy == all(int(logits[len(all_ids) - 1 - n + j].argmax()) == all_ids[len(ctx_ids) + j]
                         for j in range(n))  # fmt: skip


# --- batch invariance under torchrun layouts -------------------------------------------------


@pytest.fixture(scope="module")
def tiny_ckpt(tiny_gpt2_dir: Any, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Hugging Face GPT-2 converted to a checkpoint (2 layers, 2 heads: tp2 or pp2)."""
    from tools.convert_cli import main as convert_main

    ckpt = tmp_path_factory.mktemp("harness-ckpt") / "ckpt"
    assert convert_main(["from-hf", "--load", str(tiny_gpt2_dir), "--save", str(ckpt)]) == 0
    return str(ckpt)


def _layout_scores(rank: int, world: int, ckpt: str, tp: int, pp: int, batch_size: int) -> Any:
    """One rank of ``--model mlm`` loaded as under torchrun (``HarnessEngine.load``); every rank
    returns every request's result."""
    from mlm_eval.harness.backend import MLMHarnessLM

    lm = MLMHarnessLM(ckpt, tp=tp, pp=pp, batch_size=batch_size)
    pairs = _lambada_pairs(23)
    ll = lm.loglikelihood([_Req(*p) for p in pairs], disable_tqdm=True)
    rolling = lm.loglikelihood_rolling([_Req(a + b) for a, b in pairs[:6]], disable_tqdm=True)
    return [ll, rolling]


@pytest.mark.slow
def test_scores_do_not_depend_on_batch_size_under_tp_pp_dp(tiny_ckpt: str) -> None:
    """tp2, pp2 and dp2 give bitwise the same scores at batch size 1 and 7 (the padding of
    ``ParallelGPTScorer(batch_invariant=True)``); pp2 and dp2 even equal one process bitwise,
    tp2 (its row-parallel GEMMs sum two halves) to fp32 rounding."""
    from tests.distributed import run_distributed

    one = {bs: _layout_scores(0, 1, tiny_ckpt, 1, 1, bs) for bs in (1, 7)}
    assert one[1] == one[7]
    assert len({round(x, 3) for x, _ in one[1][0]}) > 10  # many different scores
    for tp, pp in ((2, 1), (1, 2), (1, 1)):  # (1, 1) on two ranks: dp2
        got = {bs: run_distributed(_layout_scores, 2, tiny_ckpt, tp, pp, bs) for bs in (1, 7)}
        assert got[1][0] == got[1][1] == got[7][0]  # every rank has every result
        assert got[7][0] == got[1][0], (tp, pp)  # bitwise: the batch changes nothing
        if tp == 1:
            assert got[1][0] == one[1], (tp, pp)  # bitwise: the same GEMMs as one process
        else:
            ll, ref = got[1][0][0], one[1][0]
            assert [x for x, _ in ll] == pytest.approx([x for x, _ in ref], rel=1e-6)
            assert [g for _, g in ll] == [g for _, g in ref]
