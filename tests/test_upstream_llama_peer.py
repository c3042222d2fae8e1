"""megatron-core (PyPI, on CPU with gloo) as the peer for upstream Llama-family and GPT-2 files.

megatron-core builds ``GPTModel``s from Megatron-LM ``args`` (tests/megatron_core_peer.py), saves
them with its own ``dist_checkpointing`` (``torch_dist``) and as legacy ``torch`` files (megatron-core
names, and the TransformerEngine spec's names), and records its own logits. Our reader of each
file, and our ``to-hf`` export, must give those logits; megatron-core's ``dist_checkpointing.load``
must accept our ``torch_dist`` output (from ``reshard`` and from ``from-hf``) and reproduce them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip(
    "megatron.core", reason="megatron-core is a test-only extra: pip install -e '.[megatron]'"
)

from pretrain.checkpoint.opener import load_canonical  # noqa: E402
from pretrain.checkpoint.verify import ours_probe  # noqa: E402
from tests.megatron_core_peer import PROBE  # noqa: E402
from tests.preimported import run_python

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5


def _run(*argv: str, tp: int) -> None:
    proc = run_python("tests.megatron_core_peer", [*argv, "--tp", str(tp)], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _convert(*argv: str) -> None:
    from tools.convert_cli import main

    assert main(list(argv)) == 0


@pytest.fixture(scope="module")
def peer(tmp_path_factory: pytest.TempPathFactory):
    """``peer(case, tp)``: the directory megatron-core saved that case into (built once)."""
    made: dict[tuple[str, int], Path] = {}

    def get(case: str, tp: int) -> Path:
        if (case, tp) not in made:
            out = tmp_path_factory.mktemp(f"{case}_tp{tp}")
            _run("save", str(out), "--case", case, tp=tp)
            made[(case, tp)] = out
        return made[(case, tp)]

    return get


def _hf_logits(hf_dir: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), local_files_only=True).eval()
    with torch.no_grad():
        return model(PROBE).logits


CASES = [
    ("llama", 1), ("llama", 2), ("llama_qknorm", 2), ("gpt2", 2), ("gpt2_openai_gelu", 1),
    ("gpt2_squared_relu", 1),
]  # fmt: skip


@pytest.mark.parametrize("fmt", ["dist", "legacy", "legacy_te"])
@pytest.mark.parametrize(("case", "tp"), CASES)
def test_our_reader_computes_megatron_cores_function(peer, case: str, tp: int, fmt: str) -> None:
    out = peer(case, tp)
    full, spec, info = load_canonical(out / fmt)
    assert info.format == ("torch_dist" if fmt == "dist" else "torch")
    ref = torch.load(out / "logits.pt")
    got = ours_probe(full, spec, PROBE)
    assert (got - ref).abs().max().item() < TOL


@pytest.mark.parametrize(("case", "tp"), [("llama", 2), ("llama_qknorm", 2), ("gpt2_openai_gelu", 1)])
def test_to_hf_of_megatron_core_files_gives_its_logits(peer, tmp_path: Path, case: str, tp: int) -> None:
    out = peer(case, tp)
    for fmt in ("dist", "legacy_te"):
        _convert("to-hf", "--load", str(out / fmt), "--save", str(tmp_path / fmt), "--weights-only")
        ref = torch.load(out / "logits.pt")
        assert (_hf_logits(tmp_path / fmt) - ref).abs().max().item() < TOL


@pytest.mark.parametrize(("case", "load_tp"), [("llama", 2), ("gpt2", 1)])
def test_megatron_core_loads_our_resharded_torch_dist(peer, tmp_path: Path, case: str, load_tp: int) -> None:
    out = peer(case, 2)
    save = tmp_path / "ours"
    _convert("reshard", "--load", str(out / "legacy"), "--save", str(save), "--target-tp", "1",
             "--target-pp", "1", "--ckpt-format", "torch_dist", "--verify")  # fmt: skip
    _run("load", str(save / "iter_0000001"), str(tmp_path / "loaded"), tp=load_tp)
    ref = torch.load(out / "logits.pt")
    assert (torch.load(tmp_path / "loaded" / "logits.pt") - ref).abs().max().item() < TOL


def test_megatron_core_loads_our_from_hf_torch_dist(peer, tmp_path: Path) -> None:
    out = peer("llama", 1)
    _convert("to-hf", "--load", str(out / "dist"), "--save", str(tmp_path / "hf"), "--weights-only")
    _convert("from-hf", "--load", str(tmp_path / "hf"), "--save", str(tmp_path / "ours"), "--tp", "2",
             "--ckpt-format", "torch_dist", "--weights-only", "--verify")  # fmt: skip
    _run("load", str(tmp_path / "ours" / "release"), str(tmp_path / "loaded"), tp=2)
    hf = _hf_logits(tmp_path / "hf")
    assert (torch.load(tmp_path / "loaded" / "logits.pt") - hf).abs().max().item() < TOL
