"""Sequence parallelism (``--sequence-parallel``) equals one process on loss and every gradient:
GPT-2, BERT (pre- and post-LN), Llama shapes (RoPE, GQA, SwiGLU, QK-norm) and a mixture of experts,
at TP 2 and TP 2 x PP 2,
and with data parallelism and the distributed optimizer."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from pretrain.config import ModelConfig
from pretrain.models.bert import bert_forward_step, bert_model_provider
from pretrain.models.sharding import gather_full_state_dict, load_full_state_dict
from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.state import ParallelState
from pretrain.pipeline.embedding_sync import allreduce_embedding_grads
from pretrain.pipeline.partition import build_model_chunks
from pretrain.pipeline.schedules import forward_backward, gpt_forward_step
from pretrain.tensor_parallel.sequence_parallel import allreduce_sequence_parallel_grads
from tests import test_bert_model as bert
from tests.distributed import run_distributed
from tests.gpt_fixtures import batch, full_weights, single_process_reference, tiny_config
from tests.llama_fixtures import llama_config
from tests.test_llama_parallel import llama_weights
from tests.test_moe_parallel import moe_config, moe_weights

TOL = {"rtol": 1e-5, "atol": 1e-6}


def _case(family: str) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """4-layer config, full weights and a batch whose sequence (8 or 12) splits over TP 2."""
    if family == "gpt2":
        cfg = tiny_config(num_layers=4, num_attention_heads=4)
        return cfg, full_weights(cfg), batch(cfg, b=4, s=8)
    if family == "llama":
        cfg = llama_config(num_layers=4, qk_layernorm=True, add_qkv_bias=True)
        return cfg, llama_weights(cfg), batch(cfg, b=4, s=8)
    if family == "moe":
        cfg = moe_config(num_layers=4)
        return cfg, moe_weights(cfg), batch(cfg, b=4, s=8)
    cfg = bert.bert_config(post_layernorm=family == "bert-postln")
    return cfg, bert.full_weights(cfg), bert.bert_batch(cfg, b=4, s=12)


def _reference(family: str, cfg: ModelConfig, weights, data):
    if family.startswith("bert"):
        return bert.single_process_step(cfg, weights, data)
    _, loss, grads = single_process_reference(cfg, weights, data)
    return loss, grads


def _sp_step(rank: int, world: int, family: str, cfg: ModelConfig, weights, data, tp: int, pp: int):
    """One forward/backward of ``data`` in 2 microbatches through the pipeline schedule."""
    ps = ParallelState.from_distributed(ParallelConfig(tp=tp, pp=pp), seed=0)
    is_bert = family.startswith("bert")
    chunks = build_model_chunks(cfg, ps, bert_model_provider() if is_bert else None)
    for chunk in chunks:
        load_full_state_dict(chunk, weights)
    if is_bert:
        loss_fn = bert._loss_fn(data)
    else:
        total = data["loss_mask"].sum()
        loss_fn = lambda losses, mb: (losses * mb["loss_mask"]).sum() / total  # noqa: E731

    def finalize() -> None:
        allreduce_embedding_grads(chunks, ps)
        allreduce_sequence_parallel_grads(chunks, ps.tp_group)

    losses, _ = forward_backward(
        chunks=chunks, ps=ps, microbatches=bert._microbatches(data, 2), loss_fn=loss_fn, finalize_grads=finalize,
        forward_step=bert_forward_step if is_bert else gpt_forward_step,
    )  # fmt: skip
    grads: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        grads.update(gather_full_state_dict(chunk, grads=True))
    return {"last": ps.is_last_stage, "loss": torch.stack(losses).sum() if losses else None, "grads": grads}


@pytest.mark.slow
@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("family", ["gpt2", "llama", "bert", "bert-postln", "moe"])
def test_tp2_sequence_parallel_equals_single_process(family: str, pp: int) -> None:
    cfg, weights, data = _case(family)
    ref_loss, ref_grads = _reference(family, cfg, weights, data)
    sp_cfg = dataclasses.replace(cfg, sequence_parallel=True)
    results = run_distributed(_sp_step, 2 * pp, family, sp_cfg, weights, data, 2, pp)
    merged: dict[str, torch.Tensor] = {}
    for r in results:
        merged.update(r["grads"])
        if r["last"]:
            torch.testing.assert_close(r["loss"], ref_loss, **TOL)
    assert set(merged) == set(ref_grads)
    for name, g in ref_grads.items():
        for r in results:
            if name in r["grads"]:
                torch.testing.assert_close(r["grads"][name], g, **TOL, msg=lambda m, n=name: f"{n}: {m}")


def _marked(rank: int, world: int, cfg: ModelConfig) -> list[str]:
    ps = ParallelState.from_distributed(ParallelConfig(tp=world), seed=0)
    (model,) = build_model_chunks(cfg, ps, bert_model_provider())
    return sorted(n for n, p in model.named_parameters() if getattr(p, "sequence_parallel", False))


@pytest.mark.slow
def test_sequence_parallel_parameters_are_the_norms_and_row_parallel_biases() -> None:
    """Megatron's ``sequence_parallel`` attribute: the position and token-type embeddings (looked up
    at this rank's positions), post-LN BERT's embedding norm, every layer norm, and the
    output-projection / fc2 biases; nothing inside the TP region or in the heads."""
    cfg = bert.bert_config(num_layers=1, post_layernorm=True, sequence_parallel=True)
    marked = run_distributed(_marked, 2, cfg)[0]
    layer = "language_model.encoder.layers.0."
    assert marked == sorted([
        "language_model.embedding.layernorm.weight", "language_model.embedding.layernorm.bias",
        "language_model.embedding.position_embeddings.weight", "language_model.embedding.tokentype_embeddings.weight",
        *(layer + n + s for n in ("post_attention_layernorm", "post_mlp_layernorm") for s in (".weight", ".bias")),
        layer + "self_attention.dense.bias", layer + "mlp.dense_4h_to_h.bias",
    ])  # fmt: skip


@pytest.mark.slow
def test_tp2_pp2_dp2_zero1_sequence_parallel_training_equals_single_process() -> None:
    from pretrain.distributed import DDPConfig
    from tests.dp_training import OPT, global_batches, reference, worker_pipeline

    cfg = llama_config(num_layers=4)
    weights, batches = llama_weights(cfg), global_batches(cfg, steps=2)
    opt_cfg = dataclasses.replace(OPT, use_distributed_optimizer=True)
    ref, _, _ = reference(cfg, weights, batches, opt_cfg)
    sp_cfg = dataclasses.replace(cfg, sequence_parallel=True)
    ddp_cfg = DDPConfig(use_distributed_optimizer=True)
    for r in run_distributed(worker_pipeline, 8, 2, 2, sp_cfg, weights, batches, ddp_cfg, opt_cfg, 2):
        for name, v in r["params"].items():
            torch.testing.assert_close(v, ref[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow
def test_cli_tp2_pp2_sequence_parallel_selective_losses_equal_single_process(
    gpt_data: dict[str, str], tmp_path: Path
) -> None:
    """``mlm-pretrain --sequence-parallel --recompute-granularity selective`` under torchrun: the
    training loop's finalize sums the sequence-parallel gradients (else iteration 2 drifts)."""
    from pretrain.training.cli import main as pretrain_main
    from tests.distributed import launch
    from tests.train_fixtures import gpt_args

    assert pretrain_main(gpt_args(gpt_data, **{"log-json": tmp_path / "one.jsonl"})) == 0
    flags = gpt_args(gpt_data, **{"log-json": tmp_path / "four.jsonl", "tp": 2, "pp": 2, "micro-batch-size": 1,
                                  "sequence-parallel": True, "recompute-granularity": "selective"})  # fmt: skip
    proc = launch(4, "pretrain.training.cli", flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, four = (
        [json.loads(line)["loss"] for line in (tmp_path / n).read_text().splitlines() if "loss" in line]
        for n in ("one.jsonl", "four.jsonl")
    )
    assert len(one) == len(four) == 4
    torch.testing.assert_close(torch.tensor(four), torch.tensor(one), rtol=1e-5, atol=1e-6)


def test_sequence_not_divisible_by_tp_is_one_line(
    gpt_data: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    from pretrain.training.cli import main as pretrain_main
    from tests.train_fixtures import gpt_args

    with pytest.raises(SystemExit) as exc:
        pretrain_main(gpt_args(gpt_data, **{"tp": 2, "sequence-parallel": True, "seq-length": 31}))
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.splitlines() == [err]
        and "--seq-length 31 is not divisible by --tensor-model-parallel-size 2" in err
    )


def test_checkpoints_record_the_model_without_memory_options() -> None:
    """A run's SP / recompute choice is not the model's: evaluation, generation and finetuning of
    its checkpoint (at any TP, with KV caches and pruned queries) start from plain TP."""
    from pretrain.checkpoint.args import build_metadata

    cfg = tiny_config(sequence_parallel=True, recompute_granularity="full", recompute_method="block",
                      recompute_num_layers=1)  # fmt: skip
    meta = build_metadata(cfg, ParallelConfig(tp=2), kind="gpt")
    assert meta.model == tiny_config()


def _lora_refused(rank: int, world: int, cfg: ModelConfig) -> str:
    from pretrain.models.gpt import GPTModel
    from pretrain.models.lora import LoraConfig, add_lora
    from pretrain.utils.errors import UserError

    model = GPTModel(cfg, ParallelState.from_distributed(ParallelConfig(tp=world), seed=0))
    with pytest.raises(UserError) as exc:
        add_lora(model, LoraConfig(rank=2, alpha=4.0), seed=0)
    return str(exc.value)


@pytest.mark.slow
def test_lora_with_sequence_parallel_is_refused_in_one_line() -> None:
    cfg = llama_config(sequence_parallel=True)
    assert "LoRA with --sequence-parallel is not supported" in run_distributed(_lora_refused, 2, cfg)[0]
