"""LoRA checkpoints hold the adapter alone plus the base's path and fingerprint; resume is bitwise."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pretrain.checkpoint.args import checkpoint_args
from pretrain.checkpoint.fingerprint import weights_fingerprint
from pretrain.checkpoint.lora_adapter import (
    LoraBase,
    check_base,
    find_adapter_file,
    is_lora_checkpoint,
    read_adapter,
)
from pretrain.distributed import DDPConfig, DistributedDataParallel
from pretrain.models.families import llama as hf_llama
from pretrain.models.gpt import GPTModel
from pretrain.models.lora import add_lora, is_lora_name
from pretrain.models.sharding import gather_full_state_dict, load_full_state_dict
from pretrain.optim import build_optimizer
from pretrain.optim.config import LRScheduleConfig
from pretrain.optim.lr_schedule import LRScheduler
from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.state import ParallelState
from pretrain.training.checkpointing import (
    load_model_weights,
    restore_training_state,
    save_training_checkpoint,
)
from pretrain.training.config import TrainingConfig
from pretrain.utils.errors import UserError
from tests.dp_training import OPT, global_batches, train_pp1
from tests.lora_fixtures import LORA, tiny_hf


def _build(weights, cfg, *, seed: int):
    ps = ParallelState.single(seed=0)
    model = GPTModel(cfg, ps)
    load_full_state_dict(model, weights)
    add_lora(model, LORA, seed=seed)
    ddp = DistributedDataParallel(model, ps, DDPConfig())
    opt = build_optimizer(OPT, [ddp], ps)
    sched = LRScheduler(LRScheduleConfig(lr=OPT.lr, min_lr=0.0, warmup_iters=1, decay_iters=10), opt)
    return ps, model, ddp, opt, sched


def _train(ps, model, ddp, opt, sched, batches) -> None:
    for data in batches:
        sched.step(1)  # the LR of this step (warmup from 0)
        train_pp1(ps, model, ddp, opt, [data], num_micro=1)


def _adapters(model: GPTModel) -> dict[str, torch.Tensor]:
    return {k: v for k, v in gather_full_state_dict(model).items() if is_lora_name(k)}


def test_adapter_checkpoint_round_trip_and_bitwise_resume(tmp_path: Path) -> None:
    hf = tiny_hf()
    cfg = hf_llama.model_config_from_hf(hf.config)
    weights = hf_llama.hf_to_canonical(hf.state_dict(), cfg)
    base = LoraBase(path="/base/ckpt", fingerprint=weights_fingerprint(weights))
    batches = global_batches(cfg, steps=3, b=2, s=8)
    ps, model, ddp, opt, sched = _build(weights, cfg, seed=1)
    _train(ps, model, ddp, opt, sched, batches[:2])
    args = checkpoint_args(cfg, ParallelConfig(), model_type="gpt")
    with pytest.raises(ValueError, match="lora_base"):
        save_training_checkpoint(tmp_path, 2, [model], ps, opt, sched, args)
    save_training_checkpoint(tmp_path, 2, [model], ps, opt, sched, args, lora_base=base)

    rank_file = torch.load(tmp_path / "iter_0000002/mp_rank_00/model_optim_rng.pt", weights_only=False)
    tensors = [k for k, v in rank_file["model"].items() if isinstance(v, torch.Tensor)]
    assert len(tensors) == 16 and all("lora_" in k for k in tensors)  # no base weights
    assert find_adapter_file(tmp_path) == tmp_path / "iter_0000002/mp_rank_00/lora_adapter.pt"
    adapter = read_adapter(tmp_path)
    assert adapter.lora == LORA and adapter.base == base and adapter.iteration == 2
    want = _adapters(model)
    assert adapter.tensors.keys() == want.keys()
    assert all(torch.equal(adapter.tensors[k], want[k]) for k in want)
    assert all(want[k].any() for k in want)  # trained: B moved off zero
    check_base(adapter, weights_fingerprint(weights), where="--load")
    other = dict(weights, **{"language_model.encoder.final_layernorm.weight": torch.zeros(48)})
    with pytest.raises(UserError, match=r"--load: the base weights \(fingerprint w2:.*\) are not the ones"):
        check_base(adapter, weights_fingerprint(other), where="--load")

    # resume: base weights from the base, adapter + optimizer + scheduler + RNG from the checkpoint
    ps2, model2, ddp2, opt2, sched2 = _build(weights, cfg, seed=7)
    rest = load_model_weights(tmp_path, [model2], ps2, model_type="gpt")
    tcfg = TrainingConfig(micro_batch_size=2, global_batch_size=2, train_iters=3, seq_length=8)
    assert restore_training_state(rest, ps2, opt2, sched2, tcfg) == 2
    _train(ps, model, ddp, opt, sched, batches[2:])
    _train(ps2, model2, ddp2, opt2, sched2, batches[2:])
    after, resumed = _adapters(model), _adapters(model2)
    assert all(torch.equal(after[k], resumed[k]) for k in after)


def test_not_a_lora_checkpoint(tmp_path: Path) -> None:
    assert not is_lora_checkpoint(tmp_path)
    with pytest.raises(UserError, match="not a LoRA checkpoint"):
        read_adapter(tmp_path)


def _save_worker(rank: int, world: int, weights, adapters, root: str, fingerprint: str, tp: int):
    from pretrain.pipeline.partition import build_model_chunks

    ps = ParallelState.from_distributed(ParallelConfig(tp=tp, pp=world // tp), seed=0)
    cfg = hf_llama.model_config_from_hf(tiny_hf().config)
    chunks = build_model_chunks(cfg, ps)
    for c in chunks:
        load_full_state_dict(c, weights)
        add_lora(c, LORA, seed=1)
        load_full_state_dict(c, adapters, strict=False)
    ddps = [DistributedDataParallel(c, ps, DDPConfig()) for c in chunks]
    opt = build_optimizer(OPT, ddps, ps)
    sched = LRScheduler(LRScheduleConfig(lr=OPT.lr, min_lr=0.0, warmup_iters=1, decay_iters=10), opt)
    args = checkpoint_args(cfg, ParallelConfig(tp=tp, pp=world // tp), model_type="gpt")
    save_training_checkpoint(
        root, 4, chunks, ps, opt, sched, args, lora_base=LoraBase(path="b", fingerprint=fingerprint)
    )
    return 0


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_parallel_save_gathers_the_whole_adapter(tmp_path: Path, tp: int) -> None:
    """Saved at pp2 (tp1) or tp2: lora_adapter.pt holds every layer's full adapter, as one process has it."""
    from tests.distributed import run_distributed
    from tests.lora_fixtures import ours_from_hf, randomise_adapters

    hf = tiny_hf()
    cfg = hf_llama.model_config_from_hf(hf.config)
    weights = hf_llama.hf_to_canonical(hf.state_dict(), cfg)
    adapters = randomise_adapters(ours_from_hf(hf))
    fp = weights_fingerprint(weights)
    run_distributed(_save_worker, 2, weights, adapters, str(tmp_path), fp, tp)
    got = read_adapter(tmp_path)
    assert got.tensors.keys() == adapters.keys()
    assert all(torch.equal(got.tensors[k], adapters[k]) for k in adapters)
