"""Train tiny tokenizers offline, deterministically (for the demo and the tests).

By default they learn from the built-in corpus (:func:`pretrain.data.builtin.builtin_corpus_path`).
Each function returns ``out_dir``; the files are written atomically (temporary file, rename):

* :func:`train_tiny_gpt2_bpe` -> ``vocab.json`` + ``merges.txt`` (``<|endoftext|>`` is id 0);
  use with ``--tokenizer-type GPT2BPETokenizer``.
* :func:`train_tiny_wordpiece` -> ``vocab.txt`` with ``[PAD] [UNK] [CLS] [SEP] [MASK]`` first;
  use with ``--tokenizer-type BertWordPieceLowerCase`` (or ``BertWordPieceCase`` with
  ``lower_case=False``).
* :func:`train_tiny_sentencepiece` -> ``spm.model`` (unk 0, bos 1, eos 2, pad 3); use with
  ``--tokenizer-type SentencePieceTokenizer`` or ``GPTSentencePieceTokenizer``.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import string
import tempfile
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from pretrain.utils.atomic import atomic_open


def _corpus_texts(texts: Iterable[str] | None) -> list[str]:
    if texts is not None:
        return [str(t) for t in texts]
    from pretrain.data.builtin import builtin_corpus_path

    with open(builtin_corpus_path(), encoding="utf-8") as fh:
        return [json.loads(line)["text"] for line in fh if line.strip()]


def _install(src_dir: Path, names: list[str], out_dir: Path) -> None:
    for name in names:
        data = (src_dir / name).read_bytes()
        with atomic_open(out_dir / name, "wb") as fh:
            fh.write(data)


def train_tiny_gpt2_bpe(
    out_dir: str | os.PathLike[str], vocab_size: int = 1024, texts: Iterable[str] | None = None
) -> Path:
    """Train a GPT-2 style byte-level BPE; writes ``out_dir/vocab.json`` and ``out_dir/merges.txt``."""
    from tokenizers import ByteLevelBPETokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = ByteLevelBPETokenizer(add_prefix_space=False)
    tok.train_from_iterator(
        _corpus_texts(texts),
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        tok.save_model(tmp)
        _install(Path(tmp), ["vocab.json", "merges.txt"], out)
    return out


def _word_counts(texts: list[str], lower_case: bool) -> Counter[str]:
    """BERT-normalised, BERT-pre-tokenised word frequencies of ``texts``."""
    from tokenizers.normalizers import BertNormalizer
    from tokenizers.pre_tokenizers import BertPreTokenizer

    normalizer = BertNormalizer(lowercase=lower_case, strip_accents=None if lower_case else False)
    pre = BertPreTokenizer()
    counts: Counter[str] = Counter()
    for text in texts:
        counts.update(w for w, _ in pre.pre_tokenize_str(normalizer.normalize_str(text)))
    return counts


def _initial_vocab(words: list[str], lower_case: bool) -> list[str]:
    """Specials, then every printable ASCII character (alone and, if alphanumeric, as a ``##``
    continuation) plus the corpus's characters, so that ASCII text never maps to [UNK]."""
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    ascii_chars = string.ascii_lowercase + string.digits + string.punctuation
    if not lower_case:
        ascii_chars += string.ascii_uppercase
    alphabet = set(ascii_chars) | {c for w in words for c in w}
    for tok in [*sorted(alphabet), *sorted({"##" + c for c in alphabet if c.isalnum()})]:
        if tok not in vocab:
            vocab.append(tok)
    return vocab


def _merge_pair(syms: list[str], a: str, b: str, merged: str) -> list[str]:
    """``syms`` with every adjacent ``a b`` replaced by ``merged`` (left to right)."""
    out: list[str] = []
    j = 0
    while j < len(syms):
        if j + 1 < len(syms) and syms[j] == a and syms[j + 1] == b:
            out.append(merged)
            j += 2
        else:
            out.append(syms[j])
            j += 1
    return out


def _learn_wordpiece(
    texts: list[str], vocab_size: int, lower_case: bool, min_frequency: int = 2
) -> list[str]:
    """BPE-style WordPiece learning (as the ``tokenizers`` trainer: merges over ``c ##c ##c`` symbol
    sequences) with every tie broken by token text, so the result is the same in every process.

    (The ``tokenizers`` WordPiece trainer numbers ``##`` symbols in hash-map order, which changes its
    tie-breaking from run to run.)
    """
    counts = _word_counts(texts, lower_case)
    words = sorted(counts)
    freqs = [counts[w] for w in words]
    symbols = [[w[0]] + ["##" + c for c in w[1:]] for w in words]
    vocab = _initial_vocab(words, lower_case)
    seen = set(vocab)
    while len(vocab) < vocab_size:
        pairs: Counter[tuple[str, str]] = Counter()
        for syms, f in zip(symbols, freqs, strict=True):
            for a, b in itertools.pairwise(syms):
                pairs[(a, b)] += f
        if not pairs:
            break
        (a, b), count = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        if count < min_frequency:
            break
        merged = a + b[2:]
        symbols = [syms if len(syms) < 2 else _merge_pair(syms, a, b, merged) for syms in symbols]
        if merged not in seen:
            vocab.append(merged)
            seen.add(merged)
    return vocab


def train_tiny_wordpiece(
    out_dir: str | os.PathLike[str],
    vocab_size: int = 1024,
    texts: Iterable[str] | None = None,
    *,
    lower_case: bool = True,
) -> Path:
    """Learn a BERT WordPiece vocabulary (deterministically); writes ``out_dir/vocab.txt``.

    The vocabulary may be smaller than ``vocab_size`` when the corpus runs out of pairs seen twice.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab = _learn_wordpiece(_corpus_texts(texts), vocab_size, lower_case)
    with atomic_open(out / "vocab.txt", "w", encoding="utf-8") as fh:
        fh.write("".join(tok + "\n" for tok in vocab))
    return out


def train_tiny_sentencepiece(
    out_dir: str | os.PathLike[str],
    vocab_size: int = 512,
    texts: Iterable[str] | None = None,
    *,
    model_type: str = "bpe",
) -> Path:
    """Train a SentencePiece model (single-threaded, so deterministic); writes ``out_dir/spm.model``."""
    import sentencepiece as spm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_corpus_texts(texts)),
        model_writer=buf,
        vocab_size=vocab_size,
        model_type=model_type,
        character_coverage=1.0,
        num_threads=1,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=3,
        byte_fallback=True,
        minloglevel=2,
    )
    with atomic_open(out / "spm.model", "wb") as fh:
        fh.write(buf.getvalue())
    return out


__all__ = ["train_tiny_gpt2_bpe", "train_tiny_sentencepiece", "train_tiny_wordpiece"]
