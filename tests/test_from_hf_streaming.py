"""mlm-convert from-hf streams: the same files as the in-memory import, in about one rank file of memory.

The Hugging Face directories are written here from seeded tensors (not from a transformers
initialisation), so the digests in :data:`GOLDEN` do not move with a transformers release. They
were computed with the in-memory import (``import_hf`` + ``write_layout``) before from-hf
streamed; the streamed output must keep them, and must be byte for byte the in-memory path's.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tools.convert_cli import main

pytest.importorskip("transformers")

# sha256 over every rank file's tensors (path, dtype, shape, bytes) and the recorded weights
# fingerprint, for ``from-hf --tp 2 --pp 2`` (legacy ``torch`` files), computed before streaming.
GOLDEN = {
    "gpt2": "c8182a698619bd93902786d8f6e384980bc3fac3d2c55533ee66f536f980d8b0",
    "llama_gqa": "2ee2dcbd32b03c5449d3bbc2858185ed4ab9c1db7b51cbaf5919c85a148444db",
    "qwen2": "59f3b04f8e90c05c559a07b02bb7ee85d1606a1b26adf2d88589d70e20ddd0d5",
    "bert": "82bc969c8548b397f25ef67cdde32b03080e0628cd5a8a667a0d9026097bd561",
    "bert_bare": "473e15e025e5e869db98d3b47048769cdf2a85f8abfe2428c230a820c8276a2f",
}


def _config(case: str) -> dict[str, object]:
    """config.json of each case (tiny shapes, every family's fused or tied tensors present)."""
    if case == "gpt2":
        return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 301, "n_positions": 32,
                "n_embd": 32, "n_layer": 4, "n_head": 4, "layer_norm_epsilon": 1e-5, "bos_token_id": 0,
                "eos_token_id": 0}  # fmt: skip
    if case in ("llama_gqa", "qwen2"):
        kind = "llama" if case == "llama_gqa" else "qwen2"
        return {"model_type": kind, "architectures": [f"{kind.capitalize()}ForCausalLM"], "vocab_size": 301,
                "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 4, "num_attention_heads": 4,
                "num_key_value_heads": 2, "max_position_embeddings": 64, "tie_word_embeddings": case == "qwen2",
                "rms_norm_eps": 1e-5, "hidden_act": "silu"}  # fmt: skip
    bare = case == "bert_bare"
    return {"model_type": "bert", "architectures": ["BertModel" if bare else "BertForPreTraining"],
            "vocab_size": 301, "hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
            "intermediate_size": 48, "max_position_embeddings": 32, "layer_norm_eps": 1e-12}  # fmt: skip


def write_hf(directory: Path, case: str, **overrides: object) -> Path:
    """A Hugging Face directory of ``case``: config.json and model.safetensors of seeded values
    (shapes from transformers' model on the meta device; tied copies equal to their tie)."""
    import transformers

    config = transformers.AutoConfig.for_model(**{**_config(case), **overrides})  # type: ignore[attr-defined]
    arch = getattr(transformers, config.architectures[0])
    with torch.device("meta"):
        model = arch(config)
    gen = torch.Generator().manual_seed(0)
    state = {n: torch.randn(tuple(t.shape), generator=gen) for n, t in sorted(model.state_dict().items())}
    ties = {"lm_head.weight": "transformer.wte.weight", "cls.predictions.decoder.weight":
            "bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.bias": "cls.predictions.bias"}  # fmt: skip
    if case == "qwen2":
        state.pop("lm_head.weight")
    for name, tie in ties.items():
        if name in state and tie in state:
            state[name] = state[tie].clone()
    directory.mkdir(parents=True)
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config.to_json_file(str(directory / "config.json"))
    return directory


def _walk(prefix: str, value: object, out: list[tuple[str, torch.Tensor]]) -> None:
    if isinstance(value, torch.Tensor):
        out.append((prefix, value))
    elif isinstance(value, dict):
        for k in sorted(value, key=str):
            _walk(f"{prefix}/{k}", value[k], out)


def checkpoint_digest(ckpt: Path) -> str:
    """sha256 of the tensors of every rank file (by path) and the recorded weights fingerprint."""
    from pretrain.checkpoint.fingerprint import weights_fingerprint
    from pretrain.checkpoint.opener import open_checkpoint

    h = hashlib.sha256()
    for f in sorted(ckpt.rglob("model_optim_rng.pt")):
        tensors: list[tuple[str, torch.Tensor]] = []
        state = torch.load(f, map_location="cpu", weights_only=False)
        _walk(str(f.relative_to(ckpt)), {k: v for k, v in state.items() if k.startswith("model")}, tensors)
        for name, t in tensors:
            t = t.contiguous()
            h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    reader = open_checkpoint(ckpt)
    assert reader.metadata is not None
    # the recorded fingerprint is the written weights' (w2); the digest takes their w1 value, the
    # one recorded when the goldens were made (the rule changed, not the weights)
    assert reader.metadata.provenance.weights_fingerprint == weights_fingerprint(reader)
    h.update(weights_fingerprint(reader, scheme="w1").encode())
    return h.hexdigest()


def _from_hf(src: Path, save: Path, *extra: str) -> None:
    argv = ["from-hf", "--weights-only", "--load", str(src), "--save", str(save), "--tp", "2", "--pp", "2"]
    assert main([*argv, *extra]) == 0


@pytest.mark.parametrize("case", sorted(GOLDEN))
def test_from_hf_output_keeps_the_in_memory_golden_digest(tmp_path: Path, case: str) -> None:
    _from_hf(write_hf(tmp_path / "hf", case), tmp_path / "ck")
    assert checkpoint_digest(tmp_path / "ck") == GOLDEN[case]


@pytest.mark.parametrize("zipfile", [True, False], ids=["zip", "legacy"])
def test_from_hf_reads_pytorch_model_bin_mapped_or_whole(tmp_path: Path, zipfile: bool) -> None:
    """A ``pytorch_model.bin`` imports as its safetensors twin: memory-mapped when it is a zip
    file, read whole when it is the pre-1.6 format (which cannot be mapped)."""
    from safetensors.torch import load_file

    src = write_hf(tmp_path / "hf", "llama_gqa")
    state = load_file(str(src / "model.safetensors"))
    torch.save(state, src / "pytorch_model.bin", _use_new_zipfile_serialization=zipfile)
    (src / "model.safetensors").unlink()
    _from_hf(src, tmp_path / "ck")
    assert checkpoint_digest(tmp_path / "ck") == GOLDEN["llama_gqa"]


# (a post-LN BERT has no torch_dist form)
@pytest.mark.parametrize(("case", "fmt"), [("gpt2", "torch"), ("llama_gqa", "torch"), ("bert_bare", "torch"),
                                           ("gpt2", "torch_dist"), ("llama_gqa", "torch_dist")])  # fmt: skip
def test_streamed_files_equal_the_in_memory_import_byte_for_byte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str, fmt: str
) -> None:
    import tools.hf_io

    src = write_hf(tmp_path / "hf", case)
    _from_hf(src, tmp_path / "streamed", "--ckpt-format", fmt)
    monkeypatch.setattr(tools.hf_io, "open_hf", tools.hf_io.import_hf)  # the whole model in memory
    _from_hf(src, tmp_path / "in_memory", "--ckpt-format", fmt)
    files = sorted(p.relative_to(tmp_path / "in_memory") for p in (tmp_path / "in_memory").rglob("*"))
    assert files == sorted(p.relative_to(tmp_path / "streamed") for p in (tmp_path / "streamed").rglob("*"))
    for f in files:
        a, b = tmp_path / "in_memory" / f, tmp_path / "streamed" / f
        if f.name == ".metadata":  # torch_dist's index: all but its save id and temporary path
            assert _dcp_index(a) == _dcp_index(b)
        elif a.is_file():
            assert a.read_bytes() == b.read_bytes(), f


def _dcp_index(path: Path) -> dict[str, object]:
    """A torch_dist ``.metadata`` without ``storage_meta`` (a random save id and the temporary
    directory's name, different on every save)."""
    import pickle

    with open(path, "rb") as fh:
        meta = pickle.load(fh)  # our own test output
    return {k: v for k, v in vars(meta).items() if k != "storage_meta"}


_MEMORY_SCRIPT = textwrap.dedent(
    """
    import sys, threading, time
    from transformers import AutoConfig
    from tools.convert_cli import main

    def anon_kb():
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
        raise RuntimeError("no RssAnon")

    AutoConfig.from_pretrained(sys.argv[1])  # transformers' lazy imports, before the baseline
    peak, done = [0], threading.Event()
    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], anon_kb())
            time.sleep(0.0005)
    base = anon_kb()
    t = threading.Thread(target=sample)
    t.start()
    rc = main(["from-hf", "--weights-only", "--load", sys.argv[1], "--save", sys.argv[2], "--tp", "1", "--pp", "4"])
    done.set()
    t.join()
    print(rc, (peak[0] - base) * 1024)
    """
)


@pytest.mark.slow  # ~10 s
def test_from_hf_peak_memory_is_one_rank_file_not_the_model(tmp_path: Path) -> None:
    """A 110 MB model in 4 pipeline stages: from-hf holds one stage's file (~28 MB) and the tensor
    being built, never the model (the in-memory import held all of it, and twice)."""
    src = write_hf(tmp_path / "hf", "llama_gqa", hidden_size=384, intermediate_size=1024, num_hidden_layers=16,
                   num_attention_heads=6, num_key_value_heads=6)  # fmt: skip
    model_bytes = (src / "model.safetensors").stat().st_size
    script = tmp_path / "mem.py"
    script.write_text(_MEMORY_SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script), str(src), str(tmp_path / "ck")],
        capture_output=True, text=True, check=True, cwd=Path(__file__).parents[1],
        # Freed tensors go back to the OS at once, so RssAnon tracks live memory, not glibc's cache.
        env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"},
    )  # fmt: skip
    rc, peak = (int(x) for x in out.stdout.strip().splitlines()[-1].split())
    assert rc == 0 and model_bytes > 100e6
    assert peak < 0.5 * model_bytes, (peak, model_bytes)


@pytest.mark.parametrize("dim", [None, 0, 1])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_padded_vocabulary_shards_equal_a_split_of_the_padded_tensor(dim: int | None, tp: int) -> None:
    """shard_tensor cuts a rank's rows of the zero-padded vocabulary without building the padded
    whole (the largest copy from-hf made): the same values as padding first, then splitting."""
    from pretrain.models.sharding import shard_tensor

    full = torch.randn(301, 8, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    padded = torch.cat([full, full.new_zeros(211, 8)])
    for rank in range(tp):
        want = padded if dim is None else padded.chunk(tp, dim=dim)[rank]
        got = shard_tensor(full, dim=dim, tp_rank=rank, tp=tp, pad_rows_to=512)
        assert got.dtype == want.dtype and got.is_contiguous() and torch.equal(got, want)


def test_reading_a_directory_leaves_another_mapping_of_its_files_alone(tmp_path: Path) -> None:
    """A transformers model of the same directory in this process maps the same file; its pages
    written in place (PEFT's PiSSA/OLoRA rewrite the base weights so) survive our streamed read,
    which gives back the pages of its own mappings only."""
    from safetensors.torch import load_file

    from pretrain.checkpoint.legacy.pages import mapped_ranges
    from tools.hf_io import open_hf

    src = write_hf(tmp_path / "hf", "llama_gqa")
    weights = src / "model.safetensors"
    other = load_file(str(weights))  # a private mapping of the file, as transformers 5 loads it
    assert mapped_ranges([weights])
    file_value = other["model.norm.weight"].clone()
    other["model.norm.weight"].add_(1.0)  # written in place
    source = open_hf(src)
    for name in source.names():
        source.tensor(name)  # each read ends by giving its mapping's pages back
    assert torch.equal(other["model.norm.weight"], file_value + 1.0)
