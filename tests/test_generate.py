"""Incremental decoding: cached equals uncached (tp 1/2, pp 2, GPT-2 and Llama-style), equals transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pretrain.config import ModelConfig
from pretrain.inference.generate import GenerationConfig, generate
from pretrain.inference.sampling import SamplingConfig, filter_logits, next_tokens, row_generators
from pretrain.models.gpt import GPTModel
from pretrain.models.sharding import load_full_state_dict
from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.state import ParallelState
from tests.distributed import run_distributed
from tests.gpt_fixtures import full_weights, tiny_config

PROMPTS = [[5, 17, 300, 2], [9], [44, 45, 46, 47, 48, 49, 50], [700, 1, 1, 1, 900]]
FAMILIES = {
    "gpt2": {},
    "llama": dict(
        normalization="RMSNorm",
        swiglu=True,
        position_embedding_type="rope",
        num_query_groups=2,
        add_bias_linear=False,
    ),  # fmt: skip
}
SAMPLE = SamplingConfig(greedy=False, temperature=0.9, top_k=50, top_p=0.9, seed=3)


def _config(family: str) -> ModelConfig:
    return tiny_config(max_position_embeddings=32, **FAMILIES[family])


def _one_process(cfg: ModelConfig) -> GPTModel:
    model = GPTModel(cfg, ParallelState.single())
    load_full_state_dict(model, full_weights(cfg))
    return model.eval()


def _run_all(model: GPTModel) -> dict[str, list[list[int]]]:
    out = {}
    for name, sampling in (("greedy", SamplingConfig()), ("sample", SAMPLE)):
        for cache in (True, False):
            cfg = GenerationConfig(max_new_tokens=12, sampling=sampling, use_cache=cache)
            out[f"{name}-{'cached' if cache else 'full'}"] = generate(model, PROMPTS, cfg)
    return out


def test_top_k_and_top_p_keep_the_right_tokens() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = lambda **kw: torch.isfinite(filter_logits(logits, SamplingConfig(greedy=False, **kw)))[0].tolist()  # noqa: E731
    assert kept(top_k=2) == [True, True, False, False]
    assert kept(top_p=0.8) == [True, True, False, False]  # 0.5 + 0.3 reaches 0.8
    assert kept(top_p=0.81) == [True, True, True, False]
    assert kept(top_p=0.1) == [True, False, False, False]  # the most likely token always stays
    gens = row_generators(SAMPLE, [0, 1], torch.device("cpu"))
    again = row_generators(SAMPLE, [0, 1], torch.device("cpu"))
    wide = torch.zeros(2, 1000)
    assert torch.equal(next_tokens(wide, SAMPLE, gens), next_tokens(wide, SAMPLE, again))
    assert next_tokens(torch.tensor([[0.0, 3.0, 3.0]]), SamplingConfig()).tolist() == [1]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_cached_equals_uncached_and_batch_does_not_matter(family: str) -> None:
    model = _one_process(_config(family))
    runs = _run_all(model)
    assert runs["greedy-cached"] == runs["greedy-full"]
    assert runs["sample-cached"] == runs["sample-full"]
    assert runs["sample-cached"] != runs["greedy-cached"]
    assert all(len(r) == 12 for r in runs["greedy-cached"])
    alone = [generate(model, [p], GenerationConfig(max_new_tokens=12))[0] for p in PROMPTS]
    assert alone == runs["greedy-cached"]  # left padding and batch-mates change nothing


def test_eos_and_stop_end_a_row() -> None:
    model = _one_process(_config("gpt2"))
    free = generate(model, PROMPTS, GenerationConfig(max_new_tokens=8))
    eos = free[0][3]
    cut = generate(model, PROMPTS, GenerationConfig(max_new_tokens=8, eos_id=eos))
    assert cut[0] == free[0][: free[0].index(eos)]
    stopped = generate(
        model, PROMPTS, GenerationConfig(max_new_tokens=8), stop=lambda i, ids: len(ids) == 2 + i
    )
    assert [len(r) for r in stopped] == [2, 3, 4, 5]


def _parallel_worker(rank: int, world: int, family: str, tp: int, pp: int) -> dict[str, list[list[int]]]:
    from pretrain.pipeline.partition import build_model_chunks

    cfg = _config(family)
    ps = ParallelState.from_distributed(ParallelConfig(tp=tp, pp=pp), device=torch.device("cpu"))
    (chunk,) = build_model_chunks(cfg, ps)
    assert isinstance(chunk, GPTModel)
    load_full_state_dict(chunk, full_weights(cfg))
    return _run_all(chunk.eval())


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "tp", "pp"), [("gpt2", 2, 1), ("gpt2", 1, 2), ("llama", 2, 1), ("llama", 1, 2)]
)
def test_tensor_and_pipeline_parallel_generate_the_same_tokens(family: str, tp: int, pp: int) -> None:
    want = _run_all(_one_process(_config(family)))
    for got in run_distributed(_parallel_worker, tp * pp, family, tp, pp):
        assert got == want


def test_greedy_equals_transformers_generate(tiny_gpt2_dir: Path) -> None:
    from transformers import GPT2LMHeadModel

    from pretrain.models.families.gpt2 import hf_to_canonical, model_config_from_hf

    hf: Any = GPT2LMHeadModel.from_pretrained(tiny_gpt2_dir).eval()
    cfg = model_config_from_hf(hf.config, hidden_dropout=0.0, attention_dropout=0.0)
    ours = GPTModel(cfg, ParallelState.single())
    load_full_state_dict(ours, hf_to_canonical(hf.state_dict(), cfg))
    eos = hf.config.eos_token_id
    prompts = [[p % cfg.vocab_size for p in prompt] for prompt in PROMPTS]
    for cache in (True, False):
        got = generate(ours.eval(), prompts, GenerationConfig(max_new_tokens=16, use_cache=cache, eos_id=eos))
        for prompt, tokens in zip(prompts, got, strict=True):
            with torch.no_grad():
                ref = hf.generate(
                    torch.tensor([prompt]), max_new_tokens=16, do_sample=False, pad_token_id=eos
                )
            ref_new = ref[0, len(prompt) :].tolist()
            assert tokens == (ref_new[: ref_new.index(eos)] if eos in ref_new else ref_new)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_mlm_generate_hf_model_equals_transformers_generate(
    tiny_gpt2_dir: Path, dtype: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``mlm-generate --hf-model`` with the shared ``--dtype`` flag: the weights run in that dtype."""
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationMixin

    from mlm_eval.generation.cli import main

    seen: list[torch.dtype] = []
    original = GenerationMixin.generate

    def spy(self: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(self.dtype)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "generate", spy)
    prompt = "the quick brown fox"
    assert main(["--hf-model", str(tiny_gpt2_dir), "--prompt", prompt, "--max-new-tokens", "8", "--json",
                 "--dtype", dtype]) == 0  # fmt: skip
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    assert seen == [torch_dtype]
    got = json.loads(capsys.readouterr().out)
    hf: Any = AutoModelForCausalLM.from_pretrained(tiny_gpt2_dir).eval().to(torch_dtype)
    tok = AutoTokenizer.from_pretrained(tiny_gpt2_dir)
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
    with torch.no_grad():
        ref = original(hf, ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.eos_token_id)
    want = ref[0, ids.shape[1] :].tolist()
    assert got["tokens"] == (want[: want.index(tok.eos_token_id)] if tok.eos_token_id in want else want)


def test_untied_llama_greedy_equals_transformers_generate() -> None:
    """An untied output layer (Llama-3 style) is what the logits come from, not the embedding."""
    from pretrain.models.families import llama as hf_llama
    from tests.llama_fixtures import hf_model

    hf: Any = hf_model("llama3")
    assert not hf.config.tie_word_embeddings
    cfg = hf_llama.model_config_from_hf(hf.config)
    ours = GPTModel(cfg, ParallelState.single())
    load_full_state_dict(ours, hf_llama.hf_to_canonical(hf.state_dict(), cfg))
    prompts = [[p % cfg.vocab_size for p in prompt] for prompt in PROMPTS]
    for cache in (True, False):
        got = generate(ours.eval(), prompts, GenerationConfig(max_new_tokens=10, use_cache=cache))
        for prompt, tokens in zip(prompts, got, strict=True):
            with torch.no_grad():
                ref = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)  # fmt: skip
            assert tokens == ref[0, len(prompt) :].tolist()
