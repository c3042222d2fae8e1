"""Paths and names of Megatron's legacy checkpoint layout.

::

    SAVE/latest_checkpointed_iteration.txt          "1000" or "release"
    SAVE/iter_0001000/mp_rank_TT/model_optim_rng.pt        (p == 1)
    SAVE/iter_0001000/mp_rank_TT_PPP/model_optim_rng.pt    (p > 1)
    SAVE/iter_0001000/mp_rank_TT_PPP/distrib_optim.pt      (distributed optimizer)
    SAVE/iter_0001000/mp_rank_TT[_PPP]_EEE/...             (expert parallelism, EP > 1)

The model state is nested as Megatron writes it: ``model["language_model"]["embedding"]
["word_embeddings"]["weight"]``, ``model["language_model"]["encoder"]["layers.0...."]`` (flat
inside the encoder), ``model["word_embeddings_for_head"]["weight"]``; virtual chunks are
``model0 .. modelV-1``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import torch

from pretrain.utils.atomic import atomic_open
from pretrain.utils.errors import UserError

TRACKER = "latest_checkpointed_iteration.txt"
MODEL_FILE = "model_optim_rng.pt"
DISTRIB_OPTIM_FILE = "distrib_optim.pt"
CHECKPOINT_VERSION = 3.0
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")  # a third part: expert-parallel rank


def iteration_dir(root: str | Path, iteration: int | str) -> Path:
    name = "release" if iteration == "release" else f"iter_{int(iteration):07d}"
    return Path(root) / name


def rank_dir_name(tp_rank: int, pp_rank: int, pp: int, ep_rank: int | None = None) -> str:
    """``mp_rank_TT[_PPP]``, and with expert parallelism Megatron's ``_EEE`` suffix (the
    expert-parallel rank; ``mp_rank_TT_EEE`` when pp is 1, as Megatron names it)."""
    name = f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return name if ep_rank is None else f"{name}_{ep_rank:03d}"


def parse_rank_dir(name: str, *, pp: int = 0, ep: int = 1) -> tuple[int, int] | None:
    """``mp_rank_TT[_PPP]`` -> (tp_rank, pp_rank); None for other names (EP ranks: see
    :func:`parse_expert_rank_dir`)."""
    key = parse_expert_rank_dir(name, pp=pp, ep=ep)
    return None if key is None or key[2] else key[:2]


def parse_expert_rank_dir(name: str, *, pp: int, ep: int) -> tuple[int, int, int] | None:
    """``mp_rank_TT[_PPP][_EEE]`` -> (tp_rank, pp_rank, ep_rank). One three-digit part is the PP
    rank unless the layout has EP > 1 and PP == 1 (``pp``, ``ep``: the sizes the args record;
    ``pp`` 0: unknown, read as PP). None for other names."""
    m = _RANK_DIR.match(name)
    if m is None:
        return None
    t, a, b = int(m.group(1)), m.group(2), m.group(3)
    if b is not None:
        return (t, int(a), int(b))
    if a is None:
        return (t, 0, 0)
    return (t, 0, int(a)) if ep > 1 and pp == 1 else (t, int(a), 0)


def first_rank_dir(iter_dir: Path) -> Path:
    """The TP/PP/EP rank 0 directory, whatever the layout (Megatron-LM's ``find_checkpoint_rank_0``)."""
    for name in ("mp_rank_00", "mp_rank_00_000", "mp_rank_00_000_000"):
        if (iter_dir / name).is_dir():
            return iter_dir / name
    others = sorted(p for p in iter_dir.iterdir() if _RANK_DIR.match(p.name) and p.is_dir())
    if not others:
        raise UserError(f"{iter_dir}: no mp_rank_* shard directories")
    return others[0]  # rank 0 is missing: the grid check names it


def read_tracker(root: str | Path) -> int | str:
    """The iteration in ``latest_checkpointed_iteration.txt`` (an int or ``"release"``)."""
    path = Path(root) / TRACKER
    if not path.exists():
        raise UserError(f"{root}: not a Megatron checkpoint directory (no {TRACKER})")
    text = path.read_text().strip()
    if text == "release":
        return "release"
    try:
        return int(text)
    except ValueError:
        raise UserError(f"{path}: expected an iteration number or 'release', found {text!r}") from None


def write_tracker(root: str | Path, iteration: int | str) -> None:
    with atomic_open(Path(root) / TRACKER, "w") as fh:
        fh.write(f"{iteration}\n")


def resolve_iteration(root: str | Path, iteration: int | str | None) -> Path:
    """The iteration directory to load: ``iteration`` if given, else the tracker's."""
    it = read_tracker(root) if iteration is None else iteration
    path = iteration_dir(root, it)
    if not path.is_dir():
        raise UserError(f"{root}: iteration directory {path.name} does not exist")
    return path


def list_rank_dirs(iter_dir: Path, *, pp: int = 0, ep: int = 1) -> dict[tuple[int, int], Path]:
    """All ``mp_rank_*`` directories of an iteration (EP rank 0's for EP > 1), keyed by (tp_rank, pp_rank)."""
    return {k[:2]: v for k, v in list_expert_rank_dirs(iter_dir, pp=pp, ep=ep).items() if k[2] == 0}


def list_expert_rank_dirs(iter_dir: Path, *, pp: int = 0, ep: int = 1) -> dict[tuple[int, int, int], Path]:
    """All ``mp_rank_*`` directories of an iteration, keyed by (tp_rank, pp_rank, ep_rank)."""
    out = {}
    for child in sorted(iter_dir.iterdir()):
        key = parse_expert_rank_dir(child.name, pp=pp, ep=ep)
        if key is not None and child.is_dir():
            out[key] = child
    if not out:
        raise UserError(f"{iter_dir}: no mp_rank_* shard directories")
    return out


# --- nested <-> flat state dicts -------------------------------------------------------------
def flatten(tree: dict, prefix: str = "") -> dict[str, torch.Tensor]:  # type: ignore[type-arg]
    """Nested dicts of tensors -> ``{"a.b.c": tensor}`` (non-tensor leaves are dropped)."""
    flat: dict[str, torch.Tensor] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        elif isinstance(value, torch.Tensor):
            flat[name] = value
    return flat


def _nest_depth(parts: list[str]) -> int:
    """How many leading name parts Megatron nests as dict levels (the rest is one flat key)."""
    if parts[0] == "language_model":
        return 3 if parts[1] == "embedding" else 2
    return 1


def nest_megatron(flat: Mapping[str, object]) -> dict:  # type: ignore[type-arg]
    """Our flat names -> Megatron's nested model state.

    ``language_model.embedding.word_embeddings.weight`` -> ``[lm][embedding][word_embeddings][weight]``;
    ``language_model.encoder.layers.0.x`` -> ``[lm][encoder]["layers.0.x"]``;
    ``lm_head.dense.weight`` -> ``[lm_head]["dense.weight"]`` (as Megatron's state_dict_for_save_checkpoint).
    """
    out: dict = {}  # type: ignore[type-arg]
    for name, tensor in flat.items():
        parts = name.split(".")
        depth = min(_nest_depth(parts), len(parts) - 1)
        node = out
        for p in parts[:depth]:
            node = node.setdefault(p, {})
        node[".".join(parts[depth:])] = tensor
    return out
