"""to-hf of GPT checkpoints megatron-core 0.16.1 itself wrote with options GPT-2 lacks (issue 25
item 2): refused with one line naming the option, or (untied head, ``--disable-bias-linear``)
exported so that transformers gives megatron-core's own logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip(
    "megatron.core", reason="megatron-core is a test-only extra: pip install -e '.[megatron]'"
)

from tests.cli_helpers import one_line_error  # noqa: E402
from tests.megatron_core_peer import PROBE  # noqa: E402
from tests.preimported import run_python
from tools.convert_cli import main  # noqa: E402

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
REFUSED = {
    "gpt2_qknorm": "qk_layernorm=True",
    "gpt2_kv_channels": "kv_channels=16",
    "gpt2_swiglu": "swiglu=True",  # with LayerNorm and learned positions
    "gpt2_gqa": "num_query_groups=2",  # with LayerNorm and learned positions
}
EXACT = ("gpt2_untied", "gpt2_no_bias")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every case saved by megatron-core (torch_dist and legacy) in one peer process."""
    out = tmp_path_factory.mktemp("mcore")
    proc = run_python("tests.megatron_core_peer", ["save-cases", str(out), *REFUSED, *EXACT], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.parametrize("fmt", ["dist", "legacy"])
@pytest.mark.parametrize("case", sorted(REFUSED))
def test_options_gpt2_lacks_are_refused(saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                        case: str, fmt: str) -> None:  # fmt: skip
    argv = ["to-hf", "--weights-only", "--load", str(saved / case / fmt), "--save", str(tmp_path / "hf")]
    err = one_line_error(main, argv, capsys)
    assert f"GPT2LMHeadModel cannot express {REFUSED[case]}" in err, err
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("fmt", ["dist", "legacy"])
@pytest.mark.parametrize("case", EXACT)
def test_export_gives_megatron_cores_logits(saved: Path, tmp_path: Path, case: str, fmt: str) -> None:
    from transformers import AutoModelForCausalLM

    argv = ["to-hf", "--weights-only", "--load", str(saved / case / fmt), "--save", str(tmp_path / "hf")]
    assert main(argv) == 0
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), local_files_only=True).eval()
    assert hf.config.tie_word_embeddings == (case != "gpt2_untied")
    with torch.no_grad():
        got = hf(PROBE).logits
    ref = torch.load(saved / case / "logits.pt")
    assert (got - ref).abs().max().item() < 1e-5
