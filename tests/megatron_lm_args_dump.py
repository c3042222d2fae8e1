"""How tests/megatron_lm_args_v019.json was made: Megatron-LM's own ``parse_args`` + ``validate_args``.

``git archive core_v0.19.0 megatron | tar -x -C SRC`` (Megatron-LM), then
``python tests/megatron_lm_args_dump.py SRC OUT.json``. core_v0.19.0 targets Python 3.12 and CUDA;
to run its argument code here (Python 3.11, CPU torch): ``typing.override`` is the identity, the
megatron modules that import ``triton`` at top level are inert stubs (kernels, not arguments),
``torch.cuda.get_device_properties`` reports an sm90 (H100) device and the environment is that of
rank 0 of 2 with ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (validate_args asserts it under TP). Values are
encoded as in tests/megatron_lm_args.json (``__dtype__``, ``__enum__``). Not run by the tests.
"""

from __future__ import annotations

import enum
import importlib.abc
import importlib.machinery
import json
import os
import re
import shlex
import sys
import types
import typing
import warnings
from pathlib import Path
from typing import Any

ARGV = shlex.split(
    "--num-layers 2 --hidden-size 64 --num-attention-heads 8 --group-query-attention --num-query-groups 2 "
    "--ffn-hidden-size 96 --normalization RMSNorm --swiglu --position-embedding-type rope "
    "--untie-embeddings-and-output-weights --disable-bias-linear --seq-length 32 --max-position-embeddings 32 "
    "--tensor-model-parallel-size 2 --micro-batch-size 1 --global-batch-size 2 --lr 1e-4 --train-iters 10 "
    "--tokenizer-type NullTokenizer --vocab-size 100 --transformer-impl local --ckpt-format torch_dist"
)


class _Inert:
    def __call__(self, *a: Any, **k: Any) -> Any:
        return a[0] if len(a) == 1 and callable(a[0]) and not k else _Inert()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Inert()


class _Stubs(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, names: set[str]) -> None:
        self.names = names

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        return importlib.machinery.ModuleSpec(name, self, is_package=True) if name in self.names else None

    def create_module(self, spec: Any) -> Any:
        mod = types.ModuleType(spec.name)
        mod.__getattr__ = lambda n: _Inert()  # type: ignore[method-assign]
        return mod

    def exec_module(self, module: Any) -> None:
        pass


def _encode(v: Any) -> Any:
    import torch

    if isinstance(v, torch.dtype):
        return {"__dtype__": str(v).removeprefix("torch.")}
    if isinstance(v, enum.Enum):
        return {"__enum__": f"{type(v).__module__}.{type(v).__qualname__}", "name": v.name}
    if isinstance(v, list | tuple):
        return [_encode(x) for x in v]
    if isinstance(v, dict):
        return {k: _encode(x) for k, x in v.items()}
    try:
        json.dumps(v)
        return v
    except TypeError:
        return {"__repr__": repr(v)}


def main(src: str, out: str) -> None:
    typing.override = getattr(typing, "override", lambda f: f)  # type: ignore[attr-defined]
    warnings.filterwarnings("ignore")
    root = Path(src)
    triton = re.compile(r"^(import|from) triton", re.M)
    stubs = {
        ".".join(p.relative_to(root).with_suffix("").parts)
        for p in (root / "megatron").rglob("*.py")
        if triton.search(p.read_text(errors="ignore"))
    }
    sys.meta_path.insert(0, _Stubs(stubs))
    sys.path.insert(0, str(root))
    import torch

    torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(major=9, minor=0)  # type: ignore[assignment]
    os.environ.update(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", CUDA_DEVICE_MAX_CONNECTIONS="1")
    from megatron.training.arguments import parse_args, validate_args

    sys.argv = ["pretrain_gpt.py", *ARGV]
    args = parse_args()
    validate_args(args, {})
    source = (
        "vars(args) of Megatron-LM core_v0.19.0 megatron/training/arguments.py parse_args()+validate_args() "
        f"for: pretrain_gpt.py {' '.join(ARGV)} (world size 2)"
    )
    doc = {"__source__": source, "args": {k: _encode(v) for k, v in sorted(vars(args).items())}}
    Path(out).write_text(json.dumps(doc, indent=0) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
