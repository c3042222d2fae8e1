"""The tokenizer travels with the checkpoint: written by every command, used by default, checked
when a flag names another one. Each test is one scenario of issue 15, run as a user would."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from mlm_eval.cli import main as eval_main
from pretrain.checkpoint.opener import open_checkpoint
from pretrain.tokenizer.loader import resolve_tokenizer
from pretrain.tokenizer.record import PROBE_TEXT
from tools.convert_cli import main as convert_main


def _fails(capsys: pytest.CaptureFixture[str], fn, argv: list[str]) -> str:  # type: ignore[no-untyped-def]
    """Run a CLI expecting exit 2 with one error line; returns that line."""
    capsys.readouterr()  # drop what earlier steps printed
    with pytest.raises(SystemExit) as exc:
        fn(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def _eval(argv: list[str], out: Path) -> dict:  # type: ignore[type-arg]
    assert eval_main([*argv, "--out", str(out), "--no-progress"]) == 0
    return json.loads(out.read_text())  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def hf_ckpt(tiny_gpt2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """HF GPT-2 with its tokenizer -> from-hf tp2 pp2 -> reshard tp1 pp1 (no tokenizer flags)."""
    root = tmp_path_factory.mktemp("travel")
    a, b = root / "tp2pp2", root / "tp1"
    assert (
        convert_main(["from-hf", "--load", str(tiny_gpt2_dir), "--save", str(a), "--tp", "2", "--pp", "2"])
        == 0
    )
    assert (
        convert_main(["reshard", "--load", str(a), "--save", str(b), "--target-tp", "1", "--target-pp", "1"])
        == 0
    )
    return {"root": root, "hf": tiny_gpt2_dir, "tp2pp2": a, "tp1": b}


def test_from_hf_and_reshard_carry_the_tokenizer(hf_ckpt: dict[str, Path]) -> None:
    for name in ("tp2pp2", "tp1"):
        reader = open_checkpoint(hf_ckpt[name])
        assert reader.metadata is not None and reader.metadata.tokenizer is not None
        assert (hf_ckpt[name] / "tokenizer" / "tokenizer.json").is_file()
        resolved = resolve_tokenizer(reader)
        assert resolved is not None and resolved.tokenizer.tokenize(PROBE_TEXT) == list(
            reader.metadata.tokenizer.probe_ids
        )
    # reshard keeps each rank file's RNG state (from-hf writes none: nothing to carry there)
    assert open_checkpoint(hf_ckpt["tp1"]).metadata.provenance.resharded_from == str(hf_ckpt["tp2pp2"])


@pytest.mark.parametrize("task", ["lambada", "wikitext103"])
def test_eval_without_tokenizer_flags_equals_hf_model(hf_ckpt: dict[str, Path], task: str) -> None:
    """HF GPT-2 -> from-hf tp2 pp2 -> reshard -> mlm-eval: exactly the numbers of --hf-model."""
    data = "builtin:lambada_sample.jsonl" if task == "lambada" else "builtin:wikitext_sample.tokens"
    extra = [] if task == "lambada" else ["--seq-length", "32", "--overlap", "8"]
    ours = _eval(
        [task, "--ckpt", str(hf_ckpt["tp1"]), "--data", data, *extra], hf_ckpt["root"] / f"{task}-ck.json"
    )
    theirs = _eval(
        [task, "--hf-model", str(hf_ckpt["hf"]), "--data", data, *extra], hf_ckpt["root"] / f"{task}-hf.json"
    )
    key = "ppl" if task == "lambada" else "adjusted_ppl"
    assert ours["metrics"][key] == pytest.approx(theirs["metrics"][key], rel=1e-6)
    assert ours["model"]["tokenizer"]["forced"] == []


def test_tokenizer_dir_with_ckpt_is_used_and_checked(
    hf_ckpt: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--tokenizer-dir works with --ckpt: the same tokenizer passes; another one is refused with
    one line naming both, unless --force-tokenizer (then the result record says so)."""
    ck, data = str(hf_ckpt["tp1"]), "builtin:lambada_sample.jsonl"
    same = _eval(["lambada", "--ckpt", ck, "--tokenizer-dir", str(hf_ckpt["hf"]), "--data", data],
                 hf_ckpt["root"] / "same.json")  # fmt: skip
    assert same["model"]["tokenizer"]["source"].startswith("--tokenizer-dir")
    from pretrain.tokenizer.train_tiny import train_tiny_gpt2_bpe

    other = str(train_tiny_gpt2_bpe(tmp_path / "other", vocab_size=300))  # fits the rows, other ids
    line = _fails(capsys, eval_main, ["lambada", "--ckpt", ck, "--tokenizer-dir", other, "--data", data])
    assert other in line and ck in line and "--force-tokenizer" in line
    forced = _eval(["lambada", "--ckpt", ck, "--tokenizer-dir", other, "--force-tokenizer", "--data", data],
                   hf_ckpt["root"] / "forced.json")  # fmt: skip
    assert forced["model"]["tokenizer"]["forced"]


def test_bert_wordpiece_tokenizer_is_refused_for_a_gpt(
    hf_ckpt: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from pretrain.tokenizer.train_tiny import train_tiny_wordpiece

    wp = train_tiny_wordpiece(tmp_path / "wp", vocab_size=300)
    for fn, argv in (
        (eval_main, ["lambada", "--ckpt", str(hf_ckpt["tp1"]), "--tokenizer-dir", str(wp), "--data",
                     "builtin:lambada_sample.jsonl"]),
        (convert_main, ["to-hf", "--load", str(hf_ckpt["tp1"]), "--save", str(tmp_path / "hf"), "--tokenizer-dir",
                        str(wp)]),
    ):  # fmt: skip
        line = _fails(capsys, fn, argv)
        assert str(wp) in line
    assert not (tmp_path / "hf").exists()


def test_checkpoint_without_any_tokenizer_is_refused(
    hf_ckpt: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bare = tmp_path / "bare"
    shutil.copytree(hf_ckpt["tp1"], bare)
    shutil.rmtree(bare / "tokenizer")
    line = _fails(
        capsys, eval_main, ["lambada", "--ckpt", str(bare), "--data", "builtin:lambada_sample.jsonl"]
    )
    assert "--tokenizer-dir" in line and str(bare) in line
    line = _fails(capsys, convert_main, ["to-hf", "--load", str(bare), "--save", str(tmp_path / "hf")])
    assert "no" in line and "tokenizer" in line


def test_from_hf_without_tokenizer_is_refused(
    tiny_gpt2_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    weights = tmp_path / "weights"
    weights.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_gpt2_dir / name, weights / name)
    line = _fails(capsys, convert_main, ["from-hf", "--load", str(weights), "--save", str(tmp_path / "ck")])
    assert str(weights) in line and "--tokenizer-dir" in line
    assert convert_main(["from-hf", "--load", str(weights), "--save", str(tmp_path / "ck"),
                         "--tokenizer-dir", str(tiny_gpt2_dir)]) == 0  # fmt: skip
    assert (tmp_path / "ck" / "tokenizer" / "tokenizer.json").is_file()


def test_reshard_and_inspect_refuse_a_wrong_vocab_size(
    hf_ckpt: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ck = str(hf_ckpt["tp1"])
    line = _fails(capsys, convert_main, ["reshard", "--load", ck, "--save", str(tmp_path / "x"), "--target-tp", "1",
                                         "--target-pp", "1", "--vocab-size", "10"])  # fmt: skip
    assert "--vocab-size" in line and "args.vocab_size" in line
    assert not (tmp_path / "x").exists()
    line = _fails(capsys, convert_main, ["inspect", ck, "--vocab-size", "10"])
    assert "10" in line


def test_pretrain_to_hf_gives_a_complete_hf_model(trained_gpt: dict[str, str], tmp_path: Path) -> None:
    """mlm-pretrain -> to-hf (no tokenizer flags) -> AutoTokenizer + AutoModelForCausalLM: same ids,
    same logits, true special ids, and text generation continues the prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, pipeline

    from pretrain.models.gpt import GPTModel
    from pretrain.models.sharding import load_full_state_dict
    from pretrain.parallel.state import ParallelState

    ck, hf = trained_gpt["ckpt"], tmp_path / "hf"
    assert (Path(ck) / "tokenizer" / "vocab.json").is_file()  # mlm-pretrain copied it
    assert convert_main(["to-hf", "--load", ck, "--save", str(hf)]) == 0
    reader = open_checkpoint(ck)
    ours = resolve_tokenizer(reader)
    assert ours is not None
    tok = AutoTokenizer.from_pretrained(str(hf), local_files_only=True)
    ids = tok(PROBE_TEXT, add_special_tokens=False)["input_ids"]
    assert ids == ours.tokenizer.tokenize(PROBE_TEXT) and len(tok) == ours.tokenizer.vocab_size
    eod = ours.tokenizer.eod
    model = AutoModelForCausalLM.from_pretrained(str(hf), local_files_only=True).eval()
    assert model.config.eos_token_id == eod == model.config.bos_token_id == tok.eos_token_id
    assert GenerationConfig.from_pretrained(str(hf)).eos_token_id == eod
    gpt = GPTModel(reader.spec.cfg, ParallelState.single())
    load_full_state_dict(gpt, {n: reader.tensor(n) for n in reader.names()})
    gpt.eval()
    x = torch.tensor([ids[:16]])
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, gpt.full_logits(gpt(x)), atol=1e-5, rtol=0)
    gen = pipeline("text-generation", model=model, tokenizer=tok)
    prompt = "The first word"
    out = gen(prompt, max_new_tokens=5, do_sample=False)[0]["generated_text"]
    assert out.startswith(prompt) and len(out) > len(prompt)


def test_upstream_args_tokenizer_is_used_when_its_files_exist(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An upstream checkpoint whose args name tokenizer_type/vocab_file/merge_file (and no
    vocab_size): those files are the tokenizer and give the true vocabulary; without them the
    vocabulary is reported unknown and nothing is scored."""
    import argparse

    from pretrain.tensor_parallel.vocab import padded_vocab_size
    from pretrain.tokenizer.train_tiny import train_tiny_gpt2_bpe
    from tests.convert_fixtures import rewrite_upstream, write_ours
    from tests.gpt_fixtures import full_weights, tiny_config

    tok_dir = train_tiny_gpt2_bpe(tmp_path / "tok", vocab_size=300)
    vocab = len(json.loads((tok_dir / "vocab.json").read_text()))
    cfg = tiny_config(vocab_size=vocab, max_position_embeddings=64)
    ck = write_ours(tmp_path / "ck", cfg, full_weights(cfg), tp=1, pp=1)
    args = argparse.Namespace(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        ffn_hidden_size=cfg.ffn_size, max_position_embeddings=cfg.max_position_embeddings,
        padded_vocab_size=padded_vocab_size(vocab, tp=1, divisible_by=128), make_vocab_size_divisible_by=128,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, params_dtype=torch.float32, openai_gelu=True,
        tokenizer_type="GPT2BPETokenizer", vocab_file=str(tok_dir / "vocab.json"),
        merge_file=str(tok_dir / "merges.txt"), hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    rewrite_upstream(ck, cfg, version=3.0, era="legacy", args=args)
    reader = open_checkpoint(ck)
    assert reader.metadata is None and reader.info.vocab_known and reader.spec.cfg.vocab_size == vocab
    assert reader.info.vocab_source == "args.tokenizer_type GPT2BPETokenizer"
    out = _eval(["lambada", "--ckpt", str(ck), "--data", "builtin:lambada_sample.jsonl"], tmp_path / "r.json")
    assert out["model"]["tokenizer"]["source"] == "args.tokenizer_type GPT2BPETokenizer"
    shutil.move(tok_dir, tmp_path / "moved")  # the files args name are gone
    reader = open_checkpoint(ck)
    assert not reader.info.vocab_known and "unknown" in reader.info.vocab_source
    line = _fails(capsys, eval_main, ["lambada", "--ckpt", str(ck), "--data", "builtin:lambada_sample.jsonl"])
    assert "no usable tokenizer" in line and "--tokenizer-dir" in line
    assert convert_main(["inspect", str(ck), "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["vocab_known"] is False and rec["tokenizer"] is None
    # given the tokenizer again, it tells the true vocabulary
    out = _eval(["lambada", "--ckpt", str(ck), "--tokenizer-dir", str(tmp_path / "moved"), "--data",
                 "builtin:lambada_sample.jsonl"], tmp_path / "r2.json")  # fmt: skip
    assert out["metrics"]["ppl"] == pytest.approx(
        json.loads((tmp_path / "r.json").read_text())["metrics"]["ppl"]
    )


def test_finetune_hf_model_without_tokenizer_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """mlm-finetune --hf-model DIR without a tokenizer stops with one line (it trained on [UNK]
    before); --tokenizer-dir makes it usable."""
    from finetune.builtin import builtin_task_dir
    from finetune.cli import main as finetune_main
    from tests.finetune_fixtures import FINETUNE_WORDS, make_tiny_hf_bert

    hf = make_tiny_hf_bert(tmp_path / "hf", FINETUNE_WORDS)
    weights = tmp_path / "weights"
    weights.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(hf / name, weights / name)
    common = ["sst2", "--data-dir", str(builtin_task_dir("sst2_tiny")), "--seq-length", "32",
              "--global-batch-size", "8", "--epochs", "0.1", "--no-progress"]  # fmt: skip
    line = _fails(
        capsys, finetune_main, [*common, "--hf-model", str(weights), "--results-dir", str(tmp_path / "a")]
    )
    assert str(weights) in line and "tokenizer" in line
    assert finetune_main([*common, "--hf-model", str(weights), "--tokenizer-dir", str(hf),
                          "--results-dir", str(tmp_path / "b")]) == 0  # fmt: skip


def test_pretrain_bert_to_hf_fill_mask(tmp_path: Path) -> None:
    """mlm-pretrain bert -> to-hf (no tokenizer flags) -> AutoTokenizer + fill-mask pipeline: the
    WordPiece ids equal ours, [MASK]/[PAD] are the true ids, the pipeline fills the mask."""
    from transformers import AutoModelForMaskedLM, AutoTokenizer, pipeline

    from pretrain.training.cli import main as pretrain_main
    from tests.train_fixtures import bert_args, make_bert_data

    data = make_bert_data(tmp_path / "data")
    ck = tmp_path / "ck"
    assert pretrain_main(bert_args(data, **{"train-iters": 2, "save": ck, "num-layers": 2})) == 0
    assert (ck / "tokenizer" / "vocab.txt").is_file()
    assert convert_main(["to-hf", "--load", str(ck), "--save", str(tmp_path / "hf")]) == 0
    ours = resolve_tokenizer(open_checkpoint(ck))
    assert ours is not None
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"), local_files_only=True)
    assert tok(PROBE_TEXT, add_special_tokens=False)["input_ids"] == ours.tokenizer.tokenize(PROBE_TEXT)
    assert (tok.mask_token_id, tok.pad_token_id) == (ours.tokenizer.mask, ours.tokenizer.pad)
    model = AutoModelForMaskedLM.from_pretrained(str(tmp_path / "hf"), local_files_only=True)
    assert model.config.pad_token_id == ours.tokenizer.pad
    filled = pipeline("fill-mask", model=model, tokenizer=tok)(f"the first {tok.mask_token} of the day")
    assert len(filled) > 0 and all(r["sequence"].startswith("the first") for r in filled)
