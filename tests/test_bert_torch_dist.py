"""BERT in megatron-core's ``torch_dist``: written with ``BertModel``'s keys and layout, read back.

* Our legacy BERT -> ``torch_dist`` -> legacy at other layouts is bit-exact, ``--verify`` passes.
* The file holds exactly the keys megatron-core's ``BertModel`` saves (``encoder.layers.*`` stacked
  one chunk a layer, ``lm_head.layer_norm``, the MLM bias as ``output_layer.bias`` padded like the
  word embeddings, ``pooler``, ``binary_head``, the ``_extra_state`` byte entries).
* A real peer (megatron-core 0.16.1 on CPU/gloo, tests/megatron_core_bert_peer.py): its
  ``dist_checkpointing.load`` accepts our output at tp 1 and 2 and its MLM and binary-head logits
  equal ours; what it saves itself our reader (and ``reshard --ckpt-format torch``) reads into the
  function it computes.
* What megatron-core's BERT cannot compute is refused with one line: post-LN BERT, tanh GeLU
  (megatron-core's head runs exact GeLU), and on reading a BERT whose head and layers ran
  different GeLUs (``bias_gelu_fusion``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from pretrain.checkpoint.metadata import OURS
from pretrain.checkpoint.opener import load_canonical
from pretrain.checkpoint.plan import ModelSpec, chunk_slots
from pretrain.checkpoint.torch_dist.writer import write_torch_dist
from pretrain.checkpoint.types import DictSource
from pretrain.config import ModelConfig
from pretrain.models.bert import BertModel
from pretrain.models.sharding import load_full_state_dict
from pretrain.parallel.config import ParallelConfig
from pretrain.parallel.state import ParallelState
from pretrain.utils.errors import UserError
from tests.convert_fixtures import rewrite_upstream, upstream_args, write_ours
from tests.megatron_core_bert_peer import MASK, PROBE, TOKENTYPES, VOCAB
from tests.ports import free_port
from tests.preimported import run_python
from tools.convert_cli import main as convert

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5


def _cfg(**kw: object) -> ModelConfig:
    base: dict[str, object] = dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, vocab_size=VOCAB,
        max_position_embeddings=32, bidirectional=True, num_tokentypes=2, gelu="erf", hidden_dropout=0.0,
        attention_dropout=0.0,
    )  # fmt: skip
    return ModelConfig(**{**base, **kw})  # type: ignore[arg-type]


def _source(**kw: object) -> DictSource:
    """A BERT (binary head) with random weights, norms near 1: every tensor matters to the logits."""
    spec = ModelSpec(kind="bert", cfg=_cfg(**kw))
    gen = torch.Generator().manual_seed(7)
    slots = chunk_slots(
        spec, tp=1, pre_process=True, post_process=True, layer_numbers=range(spec.cfg.num_layers)
    )
    full = {}
    for s in slots:
        t = 0.1 * torch.randn((VOCAB, *s.shape[1:]) if s.vocab else s.shape, generator=gen)
        full[s.canonical] = t + 1 if "layernorm.weight" in s.canonical else t
    return DictSource(spec=spec, full=full)


def _same(path: Path, src: DictSource) -> None:
    got, spec, _ = load_canonical(path)
    assert spec.kind == "bert" and spec.cfg == src.spec.cfg and spec.add_binary_head
    assert sorted(got) == sorted(src.full)
    assert all(torch.equal(got[n], src.full[n]) for n in got)


def _ours(path: Path) -> dict[str, torch.Tensor]:
    """Our BERT's MLM logits ``[b, s, V]`` and binary-head logits ``[b, 2]`` of the peer's probe."""
    full, spec, _ = load_canonical(path)
    cfg = dataclasses.replace(spec.cfg, hidden_dropout=0.0, attention_dropout=0.0)
    model = BertModel(cfg, ParallelState.single(), add_binary_head=spec.add_binary_head).eval()
    load_full_state_dict(model, full)
    with torch.no_grad():
        mlm, binary = model(PROBE, MASK, TOKENTYPES)
    assert binary is not None
    return {"mlm": mlm, "binary": binary}


def _close(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    """Equal within :data:`TOL` on the real (unpadded) positions and the binary head."""
    real = MASK.bool()
    assert got["mlm"].shape == ref["mlm"].shape
    assert (got["mlm"] - ref["mlm"])[real].abs().max().item() < TOL
    assert (got["binary"] - ref["binary"]).abs().max().item() < TOL


def _reshard(load: Path, save: Path, *flags: str) -> None:
    assert convert(["reshard", "--load", str(load), "--save", str(save), *flags, "--verify"]) == 0


@pytest.mark.parametrize(
    ("legacy", "dist_tp", "back"),
    [
        (ParallelConfig(tp=2, pp=2, vp=2), 1, ["--target-tp", "1", "--target-pp", "1"]),
        (ParallelConfig(tp=1, pp=1), 2, ["--target-tp", "2", "--target-pp", "2", "--target-vp", "2"]),
    ],
)
def test_legacy_to_torch_dist_and_back_is_exact(
    tmp_path: Path, legacy: ParallelConfig, dist_tp: int, back: list[str]
) -> None:
    src = _source(num_layers=4)
    write_ours(
        tmp_path / "legacy", src.spec.cfg, src.full, tp=legacy.tp, pp=legacy.pp, vp=legacy.vp, kind="bert"
    )
    _same(tmp_path / "legacy", src)
    _reshard(tmp_path / "legacy", tmp_path / "dist", "--target-tp", str(dist_tp), "--target-pp", "1",
             "--ckpt-format", "torch_dist")  # fmt: skip
    _same(tmp_path / "dist", src)
    _reshard(tmp_path / "dist", tmp_path / "back", *back)
    _same(tmp_path / "back", src)


def test_torch_dist_layout_is_megatron_cores_bert(tmp_path: Path) -> None:
    write_torch_dist(_source(), tmp_path / "d", ParallelConfig(tp=2, pp=1))
    md = FileSystemReader(str(tmp_path / "d" / "release")).read_metadata().state_dict_metadata
    assert not [k for k in md if k.startswith("decoder.")]
    qkv = md["encoder.layers.self_attention.linear_qkv.weight"]
    assert tuple(qkv.size) == (2, 192, 64) and len(qkv.chunks) == 2  # stacked, one chunk a layer
    assert tuple(md["encoder.layers.mlp.linear_fc1.layer_norm_bias"].size) == (2, 64)
    assert tuple(md["embedding.word_embeddings.weight"].size) == (256, 64)  # padded for tp 2
    assert tuple(md["output_layer.bias"].size) == (256,)  # the MLM bias, padded alike
    assert "output_layer.weight" not in md  # tied to the word embeddings
    for key in ("embedding.tokentype_embeddings.weight", "encoder.final_layernorm.weight",
                "lm_head.dense.weight", "lm_head.layer_norm.weight", "pooler.dense.bias", "binary_head.weight"):  # fmt: skip
        assert key in md
    for key in (
        "encoder.layers.mlp.linear_fc2._extra_state/shard_1_2",
        "output_layer._extra_state/shard_0_1",
    ):
        assert isinstance(md[key], BytesStorageMetadata)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"post_layernorm": True}, "tensor language_model.embedding.layernorm.weight (a post-LN BERT"),
        (
            {"gelu": "tanh"},
            "a BERT with tanh GeLU (model config gelu='tanh') has no megatron-core counterpart",
        ),
    ],
)
def test_what_megatron_cores_bert_cannot_compute_is_refused(
    tmp_path: Path, kw: dict[str, object], message: str
) -> None:
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        write_torch_dist(_source(**kw), tmp_path / "d", ParallelConfig(tp=1, pp=1))
    assert not (tmp_path / "d").exists() and not list(tmp_path.iterdir())


def _hf_bert(arch: str, path: Path) -> Path:
    import transformers

    config_cls = transformers.BertConfig if arch == "BertForPreTraining" else transformers.MegatronBertConfig
    cfg = config_cls(vocab_size=1001, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=32)  # fmt: skip
    torch.manual_seed(0)
    getattr(transformers, arch)(cfg).save_pretrained(str(path))
    return path


def test_from_hf_megatron_bert_to_torch_dist_and_back_is_exact(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    src = _hf_bert("MegatronBertForPreTraining", tmp_path / "src")  # pre-LN, exact GeLU: representable
    assert convert(["from-hf", "--weights-only", "--load", str(src), "--save", str(tmp_path / "d"), "--tp", "2",
                    "--ckpt-format", "torch_dist", "--verify"]) == 0  # fmt: skip
    assert (tmp_path / "d" / "release" / ".metadata").exists()
    assert (
        convert(["to-hf", "--weights-only", "--load", str(tmp_path / "d"), "--save", str(tmp_path / "out")])
        == 0
    )
    a, b = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_from_hf_post_ln_bert_to_torch_dist_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = _hf_bert("BertForPreTraining", tmp_path / "src")  # the original BERT is post-LN
    with pytest.raises(SystemExit) as exit_:
        convert(["from-hf", "--weights-only", "--load", str(src), "--save", str(tmp_path / "d"),
                 "--ckpt-format", "torch_dist"])  # fmt: skip
    assert exit_.value.code == 2
    assert "embedding.layernorm.weight (a post-LN BERT" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def _as_upstream(it_dir: Path, **fields: object) -> None:
    """Drop our record from ``common.pt``'s args (an upstream file), setting ``fields``."""
    common = torch.load(it_dir / "common.pt", weights_only=False)
    args = common["args"]
    delattr(args, OURS)
    for key, value in fields.items():
        setattr(args, key, value)
    torch.save(common, it_dir / "common.pt")


def test_upstream_bert_torch_dist_is_read_by_its_names(tmp_path: Path) -> None:
    src = _source()
    write_torch_dist(src, tmp_path / "d", ParallelConfig(tp=1, pp=1))
    _as_upstream(tmp_path / "d" / "release")
    _same(tmp_path / "d", src)  # kind bert from the tensor names, the config from args


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_bert_with_tanh_layers_and_exact_head_is_refused(tmp_path: Path, fmt: str) -> None:
    """megatron-core's (and the legacy) BERT head runs exact GeLU while ``bias_gelu_fusion`` makes
    the layers tanh: one GeLU cannot compute that, so both readers refuse it by name."""
    src = _source()
    if fmt == "torch_dist":
        write_torch_dist(src, tmp_path / "d", ParallelConfig(tp=1, pp=1))
        _as_upstream(tmp_path / "d" / "release", bias_gelu_fusion=True)
    else:
        write_ours(tmp_path / "d", src.spec.cfg, src.full, tp=1, pp=1, kind="bert")
        args = upstream_args(src.spec.cfg, tp=1, pp=1)
        args.bias_gelu_fusion, args.padded_vocab_size, args.vocab_size = True, 128, VOCAB
        rewrite_upstream(tmp_path / "d", src.spec.cfg, version=3.0, era="legacy", args=args)
    with pytest.raises(UserError, match=r"args.bias_gelu_fusion=True on a BERT: its layers run tanh GeLU"):
        load_canonical(tmp_path / "d")


# --- the real peer: megatron-core's BertModel ----------------------------------------------------


def _peer(*argv: str, tp: int) -> None:
    pytest.importorskip(
        "megatron.core", reason="megatron-core is a test-only extra: pip install -e '.[megatron]'"
    )
    port = free_port()  # other sessions run peers too
    proc = run_python(
        "tests.megatron_core_bert_peer", [*argv, "--tp", str(tp), "--port", str(port)], timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("load_tp", [1, 2])
def test_megatron_core_bert_loads_our_torch_dist(tmp_path: Path, load_tp: int) -> None:
    src = _source()
    write_ours(tmp_path / "legacy", src.spec.cfg, src.full, tp=2, pp=1, kind="bert")
    _reshard(tmp_path / "legacy", tmp_path / "dist", "--target-tp", "1", "--target-pp", "1",
             "--ckpt-format", "torch_dist")  # fmt: skip
    _peer("load", str(tmp_path / "dist" / "iter_0000003"), str(tmp_path / "peer"), tp=load_tp)
    _close(_ours(tmp_path / "legacy"), torch.load(tmp_path / "peer" / "logits.pt"))


def _layout(it_dir: Path) -> dict[str, tuple[int, ...] | None]:
    md = FileSystemReader(str(it_dir)).read_metadata().state_dict_metadata
    return {k: None if isinstance(v, BytesStorageMetadata) else tuple(v.size) for k, v in md.items()}


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_we_read_megatron_core_berts_torch_dist_and_write_its_layout(tmp_path: Path, tp: int) -> None:
    _peer("save", str(tmp_path / "mc"), tp=tp)
    ref = torch.load(tmp_path / "mc" / "logits.pt")
    _close(_ours(tmp_path / "mc" / "dist"), ref)
    _reshard(tmp_path / "mc" / "dist", tmp_path / "legacy", "--target-tp", "2", "--target-pp", "2",
             "--ckpt-format", "torch")  # fmt: skip
    _close(_ours(tmp_path / "legacy"), ref)
    _reshard(tmp_path / "legacy", tmp_path / "ours", "--target-tp", str(tp), "--target-pp", "1",
             "--ckpt-format", "torch_dist")  # fmt: skip
    assert _layout(tmp_path / "ours" / "iter_0000001") == _layout(tmp_path / "mc" / "dist" / "iter_0000001")
