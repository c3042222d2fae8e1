"""``--verify`` for conversions: run source and target on one probe batch and compare.

The probe is a fixed batch of token ids (seeded). GPT compares the logits over the vocabulary
both sides share (a Hugging Face export is trimmed to its tokenizer); BERT compares the encoder's
final hidden states, because a bare Hugging Face ``BertModel`` has no LM head to compare. Our side
runs a single-process model on the canonical tensors, Hugging Face's side its own model class;
both in fp32, dropout off. Loads each model once, so it needs memory for two copies.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from pretrain.checkpoint.opener import load_canonical
from pretrain.checkpoint.plan import ModelSpec
from pretrain.checkpoint.verify_routes import record_routes
from pretrain.models.sharding import load_full_state_dict
from pretrain.parallel.state import ParallelState
from pretrain.utils.errors import UserError

DEFAULT_TOLERANCE = 1e-4


def probe_ids(spec: ModelSpec, *, seed: int = 0, batch: int = 2, seq: int = 16) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    seq = min(seq, spec.cfg.max_position_embeddings)
    return torch.randint(0, spec.cfg.vocab_size, (batch, seq), generator=gen)


@torch.inference_mode()
def ours_probe(full: dict[str, torch.Tensor], spec: ModelSpec, ids: torch.Tensor) -> torch.Tensor:
    """GPT logits ``[b, s, V]`` or BERT final hidden states ``[b, s, h]`` of our model."""
    cfg = dataclasses.replace(spec.cfg, hidden_dropout=0.0, attention_dropout=0.0, params_dtype="float32")
    model: Any = spec.model_kind.build(
        cfg, ParallelState.single(), add_binary_head=spec.add_binary_head
    ).eval()
    load_full_state_dict(model, {k: v.float() for k, v in full.items()})
    if spec.model_kind.causal_lm:
        return model.full_logits(model(ids))  # type: ignore[no-any-return]
    from pretrain.models.bert import padding_attention_mask
    from pretrain.models.forward_context import ForwardContext

    lm = model.language_model
    x = lm.embedding(ids, None, torch.zeros_like(ids))
    return lm.encoder(x, ForwardContext(attn_mask=padding_attention_mask(torch.ones_like(ids))))


@torch.inference_mode()
def hf_probe(hf_dir: Path, spec: ModelSpec, ids: torch.Tensor) -> torch.Tensor:
    """The same probe from a Hugging Face directory (logits trimmed later to the shared vocab)."""
    import transformers

    auto = getattr(transformers, spec.model_kind.hf_auto_class)
    model = auto.from_pretrained(str(hf_dir), local_files_only=True).eval()
    if spec.model_kind.causal_lm:
        return model(ids).logits  # type: ignore[no-any-return]
    return model(
        input_ids=ids, attention_mask=torch.ones_like(ids), token_type_ids=torch.zeros_like(ids)
    ).last_hidden_state


def compare(source: torch.Tensor, target: torch.Tensor, *, tolerance: float, what: str) -> float:
    """Max absolute difference (over the shared vocabulary); raises when above ``tolerance``."""
    width = min(source.shape[-1], target.shape[-1])
    diff = float((source[..., :width].float() - target[..., :width].float()).abs().max())
    print(
        f"verify: max |{what} difference| = {diff:.3e} (tolerance {tolerance:.1e}) on a probe batch {tuple(ids_shape(source))}"
    )
    if not diff <= tolerance:
        raise UserError(f"--verify: {what} differ by {diff:.3e} > tolerance {tolerance:.1e}")
    return diff


def ids_shape(probe: torch.Tensor) -> tuple[int, int]:
    return int(probe.shape[0]), int(probe.shape[1])


def what_of(spec: ModelSpec) -> str:
    return spec.model_kind.probe_output


def verify_checkpoints(source: Path, target: Path, *, tolerance: float = DEFAULT_TOLERANCE) -> float:
    """Our checkpoint ``source`` against our checkpoint ``target`` (reshard): the probe outputs,
    and for a mixture of experts every MoE layer's router choices (:mod:`.verify_routes`)."""
    full, spec, _ = load_canonical(source)
    ids = probe_ids(spec)
    with record_routes() as before:
        a = ours_probe(full, spec, ids)
    del full
    full_t, spec_t, _ = load_canonical(target)
    with record_routes() as after:
        b = ours_probe(full_t, spec_t, ids)
    diff = compare(a, b, tolerance=tolerance, what=what_of(spec))
    after.theirs = before.ours_as_reference()
    _report_routes(
        after.check(tolerance, label="--verify", names=("new checkpoint", "source"), reference="the source")
    )
    return diff


def verify_against_hf(ckpt: Path, hf_dir: Path, *, tolerance: float = DEFAULT_TOLERANCE) -> float:
    """Our checkpoint ``ckpt`` against the Hugging Face directory ``hf_dir`` (from-hf): the probe
    outputs, and for a mixture of experts every MoE layer's router choices (:mod:`.verify_routes`)."""
    full, spec, _ = load_canonical(ckpt)
    ids = probe_ids(spec)
    with record_routes() as routes:
        ours = ours_probe(full, spec, ids)
        theirs = hf_probe(hf_dir, spec, ids)
    diff = compare(ours, theirs, tolerance=tolerance, what=what_of(spec))
    _report_routes(routes.check(tolerance, label="--verify", names=("checkpoint", "Hugging Face model"),
                                reference="transformers"))  # fmt: skip
    return diff


def _report_routes(layers: int) -> None:
    if layers:
        print(f"verify: router top-k equal in {layers} MoE layers")


def verify_optimizer(source: Path, target: Path) -> int:
    """Every optimizer state tensor of ``target`` equals the source's, bit for bit (resharding only
    moves them), as do the step, the group hyperparameters and the LR schedule; returns the count."""
    from pretrain.checkpoint.opener import open_checkpoint
    from pretrain.checkpoint.optimizer.reshard import open_optimizer_source
    from pretrain.checkpoint.optimizer.state import OPTIM_STATES

    src_reader, dst_reader = open_checkpoint(source), open_checkpoint(target)
    src, dst = open_optimizer_source(src_reader), open_optimizer_source(dst_reader)
    if src.common.essentials() != dst.common.essentials() or src.scheduler != dst.scheduler:
        raise UserError(
            "--verify: optimizer step, group hyperparameters or LR schedule differ from the source's"
        )
    count = 0
    for name in src_reader.names():
        for kind in OPTIM_STATES:
            if not torch.equal(src.state(kind, name), dst.state(kind, name)):
                raise UserError(f"--verify: optimizer state {kind} of {name} differs from the source's")
            count += 1
    print(f"verify: optimizer state identical ({count} tensors, step {dst.common.step})")
    return count
