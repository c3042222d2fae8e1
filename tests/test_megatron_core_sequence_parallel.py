"""Sequence parallelism against megatron-core: its ``GPTModel`` with ``sequence_parallel=True`` at
TP 2 on CPU/gloo (tests/megatron_core_sp_peer.py) and ours at TP 2 with ``--sequence-parallel``,
on the same weights (its torch_dist checkpoint, read by our reader), give the same training loss
and the same gradients of every parameter megatron-core tags ``sequence_parallel`` (norms and
row-parallel biases: the gradients both sum over TP at finalize)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

pytest.importorskip(
    "megatron.core", reason="megatron-core is a test-only extra: pip install -e '.[megatron]'"
)

from pretrain.checkpoint.opener import load_canonical  # noqa: E402
from pretrain.models.gpt import GPTModel  # noqa: E402
from pretrain.models.sharding import gather_full_state_dict, load_full_state_dict  # noqa: E402
from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.state import ParallelState  # noqa: E402
from pretrain.tensor_parallel.sequence_parallel import allreduce_sequence_parallel_grads  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402
from tests.megatron_core_peer import PROBE  # noqa: E402
from tests.preimported import run_python

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
TOL = {"rtol": 1e-5, "atol": 1e-6}


def _ours(rank: int, world: int, cfg, weights):
    ps = ParallelState.from_distributed(ParallelConfig(tp=world), seed=0)
    model = GPTModel(cfg, ps)
    load_full_state_dict(model, weights)
    model.train()
    loss = model(PROBE, labels=PROBE.roll(-1, dims=1)).float().mean()
    loss.backward()
    allreduce_sequence_parallel_grads([model], ps.tp_group)
    return {"loss": loss.detach(), "grads": gather_full_state_dict(model, grads=True)}


def _our_name(megatron_name: str) -> str:
    name = megatron_name.replace("decoder.", "language_model.encoder.", 1)
    for theirs, ours in ((".pre_mlp_layernorm.", ".post_attention_layernorm."),
                         (".linear_proj.", ".dense."), (".linear_fc2.", ".dense_4h_to_h.")):  # fmt: skip
        name = name.replace(theirs, ours)
    return name


# Unpadded vocabularies: megatron-core's softmax spans padded rows, ours never lets them take mass.
@pytest.mark.parametrize("case", ["llama_v256", "gpt2_v256"])
def test_tp2_sequence_parallel_step_equals_megatron_core(tmp_path: Path, case: str) -> None:
    proc = run_python(
        "tests.megatron_core_sp_peer", [str(tmp_path), "--case", case, "--tp", "2"], timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    step = torch.load(tmp_path / "step.pt")
    full, spec, _ = load_canonical(tmp_path / "dist")
    cfg = dataclasses.replace(spec.cfg, sequence_parallel=True, hidden_dropout=0.0, attention_dropout=0.0)
    ours = run_distributed(_ours, 2, cfg, full)[0]
    torch.testing.assert_close(ours["loss"], step["loss"], **TOL)
    assert len(step["grads"]) >= 5
    if case.startswith("gpt2"):  # biases added on sequence shards after the reduce-scatter
        assert any(n.endswith("linear_fc2.bias") for n in step["grads"]), sorted(step["grads"])
    for name, g in step["grads"].items():
        got = ours["grads"][_our_name(name)]
        torch.testing.assert_close(got, g, **TOL, msg=lambda m, n=name: f"{n}: {m}")
