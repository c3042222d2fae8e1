"""Tokenizers: tiny ones trained offline, round trips, special ids, factory errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pretrain.tokenizer import TOKENIZER_TYPES, Tokenizer, TokenizerConfig, build_tokenizer
from pretrain.tokenizer.train_tiny import train_tiny_gpt2_bpe, train_tiny_sentencepiece, train_tiny_wordpiece
from pretrain.utils.errors import UserError

SAMPLES = [
    "Hello world.",
    "  leading and trailing spaces  ",
    "Tabs\tand\nnew lines\r\n",
    "Ünïcödé: naïve café, Straße, 東京, emoji 🎉🚀",
    "The number 12345 is written as twelve thousand.",
    "",
    "<|endoftext|> inside text",
]


def _corpus() -> list[str]:
    from pretrain.data.builtin import builtin_corpus_path

    with open(builtin_corpus_path(), encoding="utf-8") as fh:
        return [json.loads(line)["text"] for line in fh]


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import ByteLevelBPETokenizer

    out = tmp_path_factory.mktemp("gpt2")
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(_corpus(), vocab_size=600, special_tokens=["<|endoftext|>"], show_progress=False)
    tok.save_model(str(out))
    return out


@pytest.fixture(scope="module")
def wordpiece_vocab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import BertWordPieceTokenizer

    out = tmp_path_factory.mktemp("wordpiece")
    tok = BertWordPieceTokenizer(lowercase=True)
    tok.train_from_iterator(_corpus() + ["Zebra quiz jumps!"], vocab_size=600, show_progress=False)
    tok.save_model(str(out))
    return out / "vocab.txt"


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tiny_sentencepiece(tmp_path_factory.mktemp("spm"), vocab_size=400) / "spm.model"


def _gpt2(files: Path) -> Tokenizer:
    return build_tokenizer(
        TokenizerConfig(
            "GPT2BPETokenizer", vocab_file=str(files / "vocab.json"), merge_file=str(files / "merges.txt")
        )
    )


def test_gpt2_bpe_round_trip_is_exact(gpt2_files: Path) -> None:
    tok = _gpt2(gpt2_files)
    vocab = json.loads((gpt2_files / "vocab.json").read_text())
    assert tok.vocab_size == len(vocab)
    assert tok.eod == vocab["<|endoftext|>"]
    assert (tok.cls, tok.sep, tok.pad, tok.mask) == (None, None, None, None)
    for text in SAMPLES + _corpus()[:50]:
        ids = tok.tokenize(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.detokenize(ids) == text
    # The literal end-of-document text is ordinary text, never the eod id.
    assert tok.eod not in tok.tokenize("<|endoftext|>")
    # Learned merges make common words short.
    assert len(tok.tokenize(" the weather")) <= 3


def test_gpt2_bpe_offsets_cover_the_text(gpt2_files: Path) -> None:
    tok = _gpt2(gpt2_files)
    text = "The wind will blow at about 16 kilometres per hour."
    offsets = tok.offsets(text)
    assert len(offsets) == len(tok.tokenize(text))
    assert "".join(text[a:b] for a, b in offsets) == text


def test_wordpiece_lower_and_cased(wordpiece_vocab: Path) -> None:
    lines = wordpiece_vocab.read_text(encoding="utf-8").splitlines()
    lower = build_tokenizer(TokenizerConfig("BertWordPieceLowerCase", vocab_file=str(wordpiece_vocab)))
    cased = build_tokenizer(TokenizerConfig("BertWordPieceCase", vocab_file=str(wordpiece_vocab)))
    assert lower.vocab_size == len(lines)
    assert (lower.cls, lower.sep, lower.pad, lower.mask) == tuple(
        lines.index(t) for t in ("[CLS]", "[SEP]", "[PAD]", "[MASK]")
    )
    assert lower.eod is None
    assert lower.tokenize("The Weather Report") == lower.tokenize("the weather report")
    assert lower.tokenize("Café") == lower.tokenize("cafe")  # lower-casing strips accents, as BERT uncased
    assert cased.tokenize("The") != lower.tokenize("The")
    text = "the weather in brindlecombe was sunny, and the wind was mild."
    assert lower.detokenize(lower.tokenize(text)) == text
    assert lower.detokenize(lower.tokenize("Zebra quiz jumps!")) == "zebra quiz jumps!"
    ids = lower.tokenize("unbelievably")
    assert [lower.id_to_token(i) for i in ids][1].startswith("##")


def test_wordpiece_vocab_missing_special_tokens(tmp_path: Path) -> None:
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("[PAD]\n[UNK]\nhello\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"--vocab-file .*vocab\.txt.*\[CLS\]"):
        build_tokenizer(TokenizerConfig("BertWordPieceLowerCase", vocab_file=str(vocab)))


def test_sentencepiece_megatron_flavour(spm_model: Path) -> None:
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(spm_model))
    tok = build_tokenizer(TokenizerConfig("SentencePieceTokenizer", model_path=str(spm_model)))
    n = sp.get_piece_size()
    # <CLS> <SEP> <EOD> <MASK> are appended after the model's pieces; pad/bos/eos are the model's.
    assert (tok.cls, tok.sep, tok.eod, tok.mask) == (n, n + 1, n + 2, n + 3)
    assert tok.vocab_size == n + 4
    assert tok.pad == sp.pad_id()
    for text in ["Hello world.", "The weather in Elmstead was sunny.", "Zebra 東京 🎉"]:
        assert tok.detokenize(tok.tokenize(text)) == text
    ids = tok.tokenize("first part<EOD>second part")
    assert ids.count(tok.eod) == 1
    assert tok.detokenize(ids) == "first part <EOD> second part"


def test_gpt_sentencepiece_flavour(spm_model: Path) -> None:
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(spm_model))
    tok = build_tokenizer(TokenizerConfig("GPTSentencePieceTokenizer", model_path=str(spm_model)))
    assert tok.vocab_size == sp.get_piece_size()
    assert tok.eod == sp.eos_id()
    assert tok.cls is None and tok.mask is None
    text = "Here are some sums. 20 plus 0 equals 20."
    assert tok.tokenize(text) == sp.encode_as_ids(text)
    assert tok.detokenize(tok.tokenize(text)) == text


def test_hugging_face_directory_matches_native_tokenizers(tmp_path: Path, gpt2_files: Path) -> None:
    from transformers import BertTokenizerFast, GPT2TokenizerFast

    hf_gpt2 = tmp_path / "hf-gpt2"
    GPT2TokenizerFast.from_pretrained(str(gpt2_files)).save_pretrained(str(hf_gpt2))
    hf = build_tokenizer(TokenizerConfig("HuggingFaceTokenizer", model_path=str(hf_gpt2)))
    native = _gpt2(gpt2_files)
    assert hf.vocab_size == native.vocab_size
    assert hf.eod == native.eod
    for text in SAMPLES:
        assert hf.detokenize(hf.tokenize(text)) == text
        if "<|" not in text:  # Hugging Face maps the literal special-token text to its id
            assert hf.tokenize(text) == native.tokenize(text)
    assert hf.tokenize("<|endoftext|>") == [hf.eod]
    assert len(hf.offsets("ab cd")) == len(hf.tokenize("ab cd"))

    wp_dir = train_tiny_wordpiece(tmp_path / "wp")
    hf_bert = tmp_path / "hf-bert"
    BertTokenizerFast.from_pretrained(str(wp_dir)).save_pretrained(str(hf_bert))
    hf = build_tokenizer(TokenizerConfig("HuggingFaceTokenizer", model_path=str(hf_bert)))
    wp = build_tokenizer(TokenizerConfig("BertWordPieceLowerCase", vocab_file=str(wp_dir / "vocab.txt")))
    assert hf.special_ids() == wp.special_ids()
    assert hf.tokenize("The weather in Elmstead, 12 degrees.") == wp.tokenize(
        "The weather in Elmstead, 12 degrees."
    )


def test_train_tiny_tokenizers_are_deterministic(tmp_path: Path) -> None:
    for train, names in (
        (train_tiny_gpt2_bpe, ["vocab.json", "merges.txt"]),
        (train_tiny_wordpiece, ["vocab.txt"]),
        (train_tiny_sentencepiece, ["spm.model"]),
    ):
        a = train(tmp_path / f"{train.__name__}-a")
        b = train(tmp_path / f"{train.__name__}-b")
        for name in names:
            assert (a / name).read_bytes() == (b / name).read_bytes(), (train.__name__, name)
        assert sorted(p.name for p in a.iterdir()) == sorted(names)  # no temporaries left
    gpt2 = _gpt2(tmp_path / "train_tiny_gpt2_bpe-a")
    assert 512 <= gpt2.vocab_size <= 1024
    assert gpt2.eod == 0
    wp = build_tokenizer(
        TokenizerConfig(
            "BertWordPieceLowerCase", vocab_file=str(tmp_path / "train_tiny_wordpiece-a" / "vocab.txt")
        )
    )
    assert 512 <= wp.vocab_size <= 1024
    assert (wp.pad, wp.cls, wp.sep, wp.mask) == (0, 2, 3, 4)
    assert wp.token_to_id("[UNK]") not in wp.tokenize("Any ASCII text: Zebra, quiz & jumps! #42")


@pytest.mark.parametrize(
    ("cfg", "pattern"),
    [
        (dict(tokenizer_type="NoSuchTokenizer"), r"--tokenizer-type 'NoSuchTokenizer' is not supported"),
        (dict(tokenizer_type="GPT2BPETokenizer", vocab_file="v.json"), r"needs --merge-file"),
        (dict(tokenizer_type="BertWordPieceCase"), r"needs --vocab-file"),
        (dict(tokenizer_type="SentencePieceTokenizer"), r"needs --tokenizer-model"),
    ],
)
def test_config_errors(cfg: dict, pattern: str) -> None:
    with pytest.raises(UserError, match=pattern):
        TokenizerConfig(**cfg)


def test_missing_and_invalid_files_name_file_and_flag(tmp_path: Path, gpt2_files: Path) -> None:
    merges = str(gpt2_files / "merges.txt")
    missing = tmp_path / "missing.json"
    with pytest.raises(UserError, match=rf"--vocab-file {missing}: .*not found"):
        build_tokenizer(TokenizerConfig("GPT2BPETokenizer", vocab_file=str(missing), merge_file=merges))
    bad = tmp_path / "vocab.json"
    bad.write_text("not json", encoding="utf-8")
    with pytest.raises(UserError, match=rf"--vocab-file {bad}: not a JSON vocabulary"):
        build_tokenizer(TokenizerConfig("GPT2BPETokenizer", vocab_file=str(bad), merge_file=merges))
    bad_merges = tmp_path / "merges.txt"
    bad_merges.write_text("#version: 0.2\nq z y x\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"--merge-file"):
        build_tokenizer(
            TokenizerConfig(
                "GPT2BPETokenizer", vocab_file=str(gpt2_files / "vocab.json"), merge_file=str(bad_merges)
            )
        )
    not_spm = tmp_path / "x.model"
    not_spm.write_bytes(b"\x00garbage")
    with pytest.raises(UserError, match=rf"--tokenizer-model {not_spm}: not a SentencePiece model"):
        build_tokenizer(TokenizerConfig("SentencePieceTokenizer", model_path=str(not_spm)))
    with pytest.raises(UserError, match=r"--tokenizer-model .*: Hugging Face tokenizer directory not found"):
        build_tokenizer(TokenizerConfig("HuggingFaceTokenizer", model_path=str(tmp_path / "nope")))
    with pytest.raises(UserError, match=r"--tokenizer-model .*: cannot load a Hugging Face tokenizer"):
        build_tokenizer(TokenizerConfig("HuggingFaceTokenizer", model_path=str(tmp_path)))


def test_every_type_is_buildable(
    tmp_path: Path, gpt2_files: Path, wordpiece_vocab: Path, spm_model: Path
) -> None:
    from transformers import GPT2TokenizerFast

    hf_dir = tmp_path / "hf"
    GPT2TokenizerFast.from_pretrained(str(gpt2_files)).save_pretrained(str(hf_dir))
    files = {
        "GPT2BPETokenizer": dict(
            vocab_file=str(gpt2_files / "vocab.json"), merge_file=str(gpt2_files / "merges.txt")
        ),
        "BertWordPieceLowerCase": dict(vocab_file=str(wordpiece_vocab)),
        "BertWordPieceCase": dict(vocab_file=str(wordpiece_vocab)),
        "SentencePieceTokenizer": dict(model_path=str(spm_model)),
        "GPTSentencePieceTokenizer": dict(model_path=str(spm_model)),
        "Llama2Tokenizer": dict(model_path=str(spm_model)),
        "HuggingFaceTokenizer": dict(model_path=str(hf_dir)),
    }
    assert set(files) == set(TOKENIZER_TYPES)
    for name, kwargs in files.items():
        tok = build_tokenizer(TokenizerConfig(name, **kwargs))
        assert isinstance(tok, Tokenizer)
        ids = tok.tokenize("the weather was sunny")
        assert ids and all(0 <= i < tok.vocab_size for i in ids)
        assert "weather" in tok.detokenize(ids)
