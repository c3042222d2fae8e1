"""megatron-core's own TP >= 2 saves of a GPT-2-BPE run: the vocabulary padding of the saving TP.

megatron-core pads the tokenizer's vocabulary to a multiple of ``make_vocab_size_divisible_by``
times the saving run's ``tensor_model_parallel_size`` (300 tokens: 512 rows at tp 2, not 384). Its
tp2 and tp2pp2 saves (``torch_dist`` and legacy, GPT-2 and Llama, ``args.vocab_size`` None and the
tokenizer named by ``args``) must be read with megatron-core's logits by our reader and work with
``inspect``, ``to-hf``, ``reshard`` and ``mlm-eval``; a tokenizer whose size no TP pads to the
checkpoint's rows is still refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pretrain.checkpoint.upstream.args import VocabOptions, true_vocab_size
from pretrain.utils.errors import UserError
from tests.preimported import run_python

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5
VOCAB = 300
CASES = [("gpt2", 1), ("gpt2", 2), ("llama", 1), ("llama", 2)]
_MEGATRON_ARGS = dict(tensor_model_parallel_size=2, make_vocab_size_divisible_by=128, num_attention_heads=8)


def test_padding_follows_the_saving_runs_tp() -> None:
    """The issue's case: 8000 tokens saved at tp 2 are 8192 rows (8064 at tp 1)."""
    from pretrain.tensor_parallel.vocab import padding_tp

    args = dict(_MEGATRON_ARGS, padded_vocab_size=8192, tokenizer_type="GPT2BPETokenizer")
    for layout_tp in (1, 2):  # torch_dist has no layout TP; legacy at tp 2
        got = true_vocab_size(args, 8192, tp=layout_tp, vocab=VocabOptions(size=8000), source="ck")
        assert got == (8000, "--vocab-size")
    assert padding_tp(8000, 8192, divisible_by=128, saved_tp=2, num_heads=8) == 2
    assert padding_tp(8000, 8064, divisible_by=128, saved_tp=2, num_heads=8) == 1  # kept from a tp1 run


def test_a_mismatched_tokenizer_is_still_refused() -> None:
    args = dict(_MEGATRON_ARGS, padded_vocab_size=8192)
    with pytest.raises(UserError) as err:
        true_vocab_size(
            args, 8192, tp=1, vocab=VocabOptions(tokenizer_size=5000, tokenizer_source="tok"), source="ck"
        )
    msg = str(err.value)
    assert "\n" not in msg and "tok gives 5000 tokens" in msg and "args.padded_vocab_size 8192" in msg
    assert "tensor_model_parallel_size 2" in msg


def _run(module: str, *argv: str) -> None:
    proc = run_python(module, list(argv))
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pretrain.tokenizer.train_tiny import train_tiny_gpt2_bpe

    tok = train_tiny_gpt2_bpe(tmp_path_factory.mktemp("tok"), vocab_size=VOCAB)
    assert len(json.loads((tok / "vocab.json").read_text())) == VOCAB
    return tok


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory, tokenizer: Path):
    """``saved(case, pp)``: ``(dir, logits)``: megatron-core's tp2 save (``dist``, ``legacy``) and
    its probe logits over the true vocabulary (at pp 2: from megatron-core's load of ``dist``)."""
    pytest.importorskip("megatron.core")
    made: dict[tuple[str, int], tuple[Path, torch.Tensor]] = {}

    def get(case: str, pp: int) -> tuple[Path, torch.Tensor]:
        if (case, pp) not in made:
            out = tmp_path_factory.mktemp(f"{case}_tp2pp{pp}")
            _run("tests.megatron_core_vocab_peer", str(out), str(tokenizer / "vocab.json"),
                 str(tokenizer / "merges.txt"), "--case", case, "--tp", "2", "--pp", str(pp))  # fmt: skip
            if pp > 1:
                _run("tests.megatron_core_peer", "load", str(out / "dist" / "iter_0000001"), str(out / "mc"),
                     "--tp", "2")  # fmt: skip
                (out / "logits.pt").write_bytes((out / "mc" / "logits.pt").read_bytes())
            made[(case, pp)] = (out, torch.load(out / "logits.pt")[..., :VOCAB])
        return made[(case, pp)]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["dist", "legacy"])
@pytest.mark.parametrize(("case", "pp"), CASES)
def test_reader_gives_megatron_cores_logits(saved, case: str, pp: int, fmt: str) -> None:
    from pretrain.checkpoint.opener import load_canonical
    from pretrain.checkpoint.verify import ours_probe
    from tests.megatron_core_peer import PROBE

    out, ref = saved(case, pp)
    full, spec, info = load_canonical(out / fmt)
    assert (info.tp, info.pp, info.padded_vocab_size, spec.cfg.vocab_size) == (2, pp, 512, VOCAB)
    assert info.vocab_source == "args.tokenizer_type GPT2BPETokenizer"
    assert (ours_probe(full, spec, PROBE) - ref).abs().max().item() < TOL


@pytest.mark.slow
@pytest.mark.parametrize(("case", "pp"), CASES)
def test_commands_take_megatron_cores_tp2_torch_dist(saved, tmp_path: Path, case: str, pp: int) -> None:
    from transformers import AutoModelForCausalLM

    from mlm_eval.cli import main as eval_main
    from pretrain.checkpoint.opener import load_canonical
    from pretrain.checkpoint.verify import ours_probe
    from tests.megatron_core_peer import PROBE
    from tools.convert_cli import main as convert

    out, ref = saved(case, pp)
    dist = str(out / "dist")
    assert convert(["inspect", dist]) == 0
    assert convert(["to-hf", "--load", dist, "--save", str(tmp_path / "hf"), "--weights-only"]) == 0
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), local_files_only=True).eval()
    with torch.no_grad():
        assert (hf(PROBE).logits - ref).abs().max().item() < TOL
    assert convert(["reshard", "--load", dist, "--save", str(tmp_path / "r"), "--target-tp", "1",
                    "--target-pp", "1", "--verify"]) == 0  # fmt: skip
    full, spec, _ = load_canonical(tmp_path / "r")
    assert (ours_probe(full, spec, PROBE) - ref).abs().max().item() < TOL
    assert eval_main(["lambada", "--ckpt", dist, "--data", "builtin:lambada_sample.jsonl",
                      "--out", str(tmp_path / "e.json"), "--no-progress"]) == 0  # fmt: skip
