"""``to-hf``'s check of its own output: the written Hugging Face model computes the checkpoint's function.

A probe batch (2 sequences of 16 random in-vocabulary tokens, seeded;
:func:`pretrain.checkpoint.verify.probe_ids`) runs through the export, loaded by ``transformers``
in float32, and through our own model built in float32 from the same canonical tensors. GPT
compares logits, BERT the encoder's final hidden states (a bare ``BertModel`` export has no LM
head). Both sides compute in float32 whatever the stored dtype, so one tolerance serves every
dtype: a difference passes when it is at most ``tolerance * max(1, max |ours|)``.

Two modes (``auto`` picks ``full`` for small models only: while its estimate, about 12 bytes a
parameter, stays under :data:`FULL_MODE_MAX_BYTES` and half the available memory; conversions
keep their peak memory near the model's size, which the full mode would not):

* ``full``: both whole models, end to end. On a mismatch the layers are compared one by one on the
  already loaded models to name the first that diverges.
* ``per-layer``: peak memory about one transformer layer plus the embeddings and head. The
  ``transformers`` model is built with its layers on the ``meta`` device; a forward pre-hook loads
  each layer's tensors from the written safetensors and a forward hook compares that layer's
  output with our layer's on the same input hidden states, then frees it. The embeddings (ours
  vs. the first layer's input) and the head (ours on the last layer's output vs. the logits) are
  compared too.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from pretrain.checkpoint.plan import ModelSpec
from pretrain.checkpoint.types import TensorSource
from pretrain.checkpoint.verify import ours_probe, probe_ids
from pretrain.checkpoint.verify_routes import record_routes
from pretrain.models.base import ShardedModule
from pretrain.models.sharding import load_full_state_dict
from pretrain.parallel.state import ParallelState
from pretrain.utils.errors import UserError
from tools.hf_layered_model import (
    SafetensorsDir,
    auto_class,
    layer_hooks,
    layer_loader,
    layers_of,
    output,
    per_layer_model,
    quiet_transformers,
)

VerifyMode = Literal["auto", "full", "per-layer"]
MODES: tuple[VerifyMode, ...] = ("auto", "full", "per-layer")
DEFAULT_TOLERANCE = 1e-4
FULL_MODE_MEMORY_FRACTION = 0.5  # auto: full mode while its estimate fits in this much of MemAvailable
FULL_MODE_MAX_BYTES = 1 << 30  # ... and in 1 GiB (about 90M parameters); above, per-layer
_LAYER_PREFIX = "language_model.encoder.layers."


@dataclasses.dataclass(frozen=True, kw_only=True)
class Comparison:
    """One compared stage: ``where`` (``logits``, ``embeddings``, ``layer 3``, ``output``)."""

    where: str
    diff: float
    limit: float

    @property
    def ok(self) -> bool:
        return self.diff <= self.limit  # NaN fails


@dataclasses.dataclass(frozen=True, kw_only=True)
class VerifyResult:
    """What :func:`verify_export` compared; ``worst`` is the stage closest to its limit."""

    mode: str
    what: str
    batch: tuple[int, int]
    comparisons: tuple[Comparison, ...]
    moe_layers: int = 0  # MoE layers whose router choices were compared (pretrain.checkpoint.verify_routes)

    @property
    def worst(self) -> Comparison:
        return max(self.comparisons, key=lambda c: c.diff / c.limit if c.limit else float("inf"))

    def line(self) -> str:
        w = self.worst
        what, at = (self.what, "") if self.mode == "full" else ("stage", f" (largest at {w.where})")
        routes = f"; router top-k equal in {self.moe_layers} MoE layers" if self.moe_layers else ""
        return (
            f"verify: max |{what} difference| = {w.diff:.3e} <= {w.limit:.3e}{at}, "
            f"transformers vs. the checkpoint on a {self.batch[0]}x{self.batch[1]} probe batch ({self.mode}){routes}"
        )


def compare(where: str, ours: torch.Tensor, theirs: torch.Tensor, tolerance: float) -> Comparison:
    """Max absolute difference over the shared last dimension; limit ``tolerance * max(1, max|ours|)``."""
    width = min(ours.shape[-1], theirs.shape[-1])
    a, b = ours[..., :width].float(), theirs[..., :width].float()
    if a.shape != b.shape:
        return Comparison(where=where, diff=float("inf"), limit=0.0)
    return Comparison(where=where, diff=float((a - b).abs().max()),
                      limit=tolerance * max(1.0, float(a.abs().max())))  # fmt: skip


# --- our side, piece by piece ----------------------------------------------------------------------
class OurPieces:
    """Our model in float32 from ``source``, built one piece at a time (the embeddings and head once,
    each layer on demand), so that at most one layer is in memory."""

    def __init__(self, source: TensorSource, spec: ModelSpec) -> None:
        self.source, self.spec = source, spec
        self.cfg = dataclasses.replace(
            spec.cfg, hidden_dropout=0.0, attention_dropout=0.0, params_dtype="float32"
        )
        self.ps = ParallelState.single()
        names = source.names()
        self.shell = self._model(())
        self._load(self.shell, [n for n in names if not n.startswith(_LAYER_PREFIX)])
        self._names = names

    def _model(self, layers: tuple[int, ...], *, ends: bool = True) -> ShardedModule:
        return self.spec.model_kind.build(
            self.cfg, self.ps, add_binary_head=self.spec.add_binary_head and ends, pre_process=ends,
            post_process=ends, layer_numbers=layers,
        ).eval()  # fmt: skip

    def _load(self, model: ShardedModule, names: list[str]) -> None:
        load_full_state_dict(model, {n: self.source.tensor(n).float() for n in names})

    @torch.inference_mode()
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        lm: Any = self.shell.language_model
        return lm.embedding(ids)  # type: ignore[no-any-return]  # token types (BERT): zeros

    @torch.inference_mode()
    def layer(self, i: int, x: torch.Tensor) -> torch.Tensor:
        model = self._model((i,), ends=False)
        self._load(model, [n for n in self._names if n.startswith(f"{_LAYER_PREFIX}{i}.")])
        return model(hidden_states=x)  # type: ignore[no-any-return]

    @torch.inference_mode()
    def head(self, x: torch.Tensor) -> torch.Tensor:
        """GPT: the logits ``[b, s, V]`` of the last layer's output; BERT: the final hidden states."""
        model: Any = self.shell
        x = model.language_model.encoder(x)  # no layers: the final norm only
        if not self.spec.model_kind.causal_lm:
            return x
        from pretrain.models.language_model import parallel_lm_logits

        local = parallel_lm_logits(x, model.output_weight(), ps=self.ps, vocab_start=0,
                                   true_vocab=self.cfg.vocab_size)  # fmt: skip
        return model.full_logits(local)  # type: ignore[no-any-return]


@torch.inference_mode()
def layer_by_layer(model: nn.Module, ours: OurPieces, ids: torch.Tensor, *, tolerance: float,
                   materialize: Callable[[int], None] | None = None,
                   release: Callable[[int], None] | None = None) -> list[Comparison]:  # fmt: skip
    """Run ``model`` on ``ids`` comparing every stage with ours on the same inputs (see the module
    docstring); ``materialize``/``release`` load and free each layer around its forward."""
    layers, gpt = layers_of(model), ours.spec.model_kind.causal_lm
    found: list[Comparison] = []
    last: list[torch.Tensor] = []

    def post(i: int, x: torch.Tensor, y: torch.Tensor) -> None:
        if i == 0:
            found.append(compare("embeddings", ours.embed(ids), x, tolerance))
        found.append(compare(f"layer {i}", ours.layer(i, x), y, tolerance))
        last[:] = [y]
        if release is not None:
            release(i)

    with layer_hooks(layers, pre=materialize, post=post):
        final = output(model, ids, gpt)
    found.append(compare("output", ours.head(last[0]), final, tolerance))
    return found


def _available_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def choose_mode(mode: VerifyMode, files: SafetensorsDir) -> Literal["full", "per-layer"]:
    """``auto``: full while about 12 bytes a parameter (two float32 models and our float32 copy
    of the tensors) fit in :data:`FULL_MODE_MAX_BYTES` and :data:`FULL_MODE_MEMORY_FRACTION` of the
    available memory; else per-layer."""
    if mode != "auto":
        return mode
    need = 12 * files.numel()
    limit = min(FULL_MODE_MAX_BYTES, FULL_MODE_MEMORY_FRACTION * _available_bytes())
    return "full" if need <= limit else "per-layer"


@torch.inference_mode()
def verify_export(source: TensorSource, spec: ModelSpec, hf_dir: Path, *, mode: VerifyMode = "auto",
                  tolerance: float = DEFAULT_TOLERANCE) -> VerifyResult:  # fmt: skip
    """Compare the export in ``hf_dir`` with our model of ``source`` (see the module docstring).

    Raises :class:`UserError` (one line: the max difference, its limit and the first stage that
    diverges) on a mismatch or when ``transformers`` cannot load the export; for a mixture of
    experts also when a layer's router choices differ (:mod:`pretrain.checkpoint.verify_routes`)."""
    files = SafetensorsDir(hf_dir)
    chosen = choose_mode(mode, files)
    ids = probe_ids(spec)
    what = spec.model_kind.probe_output
    try:
        with quiet_transformers(), record_routes() as routes:
            found = _run(source, spec, hf_dir, ids, chosen, tolerance)
    except UserError:
        raise
    except Exception as exc:  # transformers cannot load or run what we wrote: not an export
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise UserError(
            f"to-hf verify: transformers cannot run the export ({type(exc).__name__}: {msg})"
        ) from None
    bad = [c for c in found if not c.ok]
    if bad:
        worst = max(found, key=lambda c: c.diff)
        raise UserError(
            f"to-hf verify: the export's {what}s differ from the checkpoint's by up to {worst.diff:.3e} "
            f"(limit {bad[0].limit:.3e}); first divergence at {bad[0].where} ({chosen} comparison)"
        )
    return VerifyResult(mode=chosen, what=what, batch=(int(ids.shape[0]), int(ids.shape[1])),
                        comparisons=tuple(found), moe_layers=routes.check(tolerance))  # fmt: skip


def _run(source: TensorSource, spec: ModelSpec, hf_dir: Path, ids: torch.Tensor, chosen: str,
         tolerance: float) -> list[Comparison]:  # fmt: skip
    if chosen == "full":
        return _full(source, spec, hf_dir, ids, tolerance)
    model, files = per_layer_model(hf_dir, spec)
    materialize, release = layer_loader(model, files)
    return layer_by_layer(model, OurPieces(source, spec), ids, tolerance=tolerance,
                          materialize=materialize, release=release)  # fmt: skip


def _full(source: TensorSource, spec: ModelSpec, hf_dir: Path, ids: torch.Tensor,
          tolerance: float) -> list[Comparison]:  # fmt: skip
    """End to end; on a mismatch, the per-layer comparison on the loaded models names where."""
    model = auto_class(spec).from_pretrained(str(hf_dir), dtype=torch.float32, local_files_only=True).eval()
    ours = ours_probe({n: source.tensor(n) for n in source.names()}, spec, ids)
    causal = spec.model_kind.causal_lm
    end = compare("logits" if causal else "hidden states", ours, output(model, ids, causal), tolerance)
    if end.ok:
        return [end]
    stages = layer_by_layer(model, OurPieces(source, spec), ids, tolerance=tolerance)
    return [*[c for c in stages if not c.ok], end]
