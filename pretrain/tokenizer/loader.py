"""The one way every command gets a tokenizer from a directory, a checkpoint or upstream ``args``.

* :func:`load_tokenizer_dir` -- a tokenizer directory (ours: ``CKPT/tokenizer/``; a Hugging Face
  directory; Megatron's files ``vocab.json``+``merges.txt`` / ``vocab.txt`` / ``*.model``). The
  type is the recorded one when known, else inferred from the files (``tokenizer.json`` or
  ``tokenizer_config.json`` -> ``HuggingFaceTokenizer``). Local files only, never a download.
* :func:`describe` / :func:`save_tokenizer` -- the :class:`TokenizerRecord` a checkpoint keeps and
  the copy of the tokenizer's files into ``CKPT/tokenizer/``.
* :func:`check_tokenizer` -- a tokenizer given by flag against the recorded one and the model:
  a larger vocabulary than the model's rows, other special ids, or another encoding of
  :data:`PROBE_TEXT` is refused with one line naming both (unless forced).
* :func:`tokenizer_from_args` -- the tokenizer upstream Megatron ``args`` name, when its files exist.
"""

from __future__ import annotations

import functools
import json
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pretrain.tokenizer.base import Tokenizer
from pretrain.tokenizer.factory import TOKENIZER_TYPES, TokenizerConfig, build_tokenizer
from pretrain.tokenizer.hf import HuggingFaceTokenizer
from pretrain.tokenizer.record import PROBE_TEXT, TOKENIZER_SUBDIR, TokenizerRecord
from pretrain.utils.atomic import atomic_open
from pretrain.utils.errors import UserError

# The files of a Hugging Face tokenizer directory (copied whole for HuggingFaceTokenizer).
HF_TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "vocab.txt", "spiece.model", "tokenizer.model", "sentencepiece.bpe.model",
)  # fmt: skip


# The file names a tokenizer directory may hold, ours first, then Megatron-LM's usual ones
# (``gpt2-vocab.json``/``gpt2-merges.txt`` of its GPT-2 recipes, ``bert-large-cased-vocab.txt``).
GPT2_VOCAB_NAMES = ("vocab.json", "gpt2-vocab.json", "*-vocab.json")
GPT2_MERGES_NAMES = ("merges.txt", "gpt2-merges.txt", "*-merges.txt")
WORDPIECE_NAMES = ("vocab.txt", "*-vocab.txt")


def _find(path: Path, names: tuple[str, ...]) -> Path | None:
    """The first of ``names`` (exact names, then one glob match) in directory ``path``."""
    for name in names:
        hits = sorted(path.glob(name))
        if len(hits) > 1:
            raise UserError(
                f"{path}: several tokenizer files match {name} ({', '.join(h.name for h in hits)})"
            )
        if hits and hits[0].is_file():
            return hits[0]
    return None


def _infer_type(path: Path) -> str:
    if (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file():
        return "HuggingFaceTokenizer"
    if _find(path, GPT2_VOCAB_NAMES) and _find(path, GPT2_MERGES_NAMES):
        return "GPT2BPETokenizer"
    vocab_txt = _find(path, WORDPIECE_NAMES)
    if vocab_txt is not None:
        marker = path / "mlm_tokenizer.json"
        cased = marker.is_file() and "BertWordPieceCase" in marker.read_text(encoding="utf-8")
        cased = cased or ("-cased" in vocab_txt.name and not marker.is_file())  # bert-large-cased-vocab.txt
        return "BertWordPieceCase" if cased else "BertWordPieceLowerCase"
    if any(path.glob("*.model")):
        return "GPTSentencePieceTokenizer"
    raise UserError(
        f"{path}: no tokenizer files (tokenizer.json, vocab.json + merges.txt, gpt2-vocab.json + "
        "gpt2-merges.txt, vocab.txt or *.model)"
    )


def _config_for(path: Path, kind: str, flag: str) -> TokenizerConfig:
    if kind == "GPT2BPETokenizer":
        vocab, merges = _find(path, GPT2_VOCAB_NAMES), _find(path, GPT2_MERGES_NAMES)
        if vocab is None or merges is None:
            raise UserError(
                f"{flag} {path}: {kind} needs vocab.json + merges.txt (or gpt2-vocab.json + gpt2-merges.txt)"
            )
        return TokenizerConfig(kind, vocab_file=str(vocab), merge_file=str(merges))
    if kind in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        vocab_txt = _find(path, WORDPIECE_NAMES)
        return TokenizerConfig(kind, vocab_file=str(vocab_txt or path / "vocab.txt"))
    if kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        models = sorted(path.glob("*.model"))
        if not models:
            raise UserError(f"{flag} {path}: {kind} needs a SentencePiece *.model file there")
        return TokenizerConfig(kind, model_path=str(models[0]))
    return TokenizerConfig("HuggingFaceTokenizer", model_path=str(path))


def load_tokenizer_dir(
    path: str | Path, *, tokenizer_type: str | None = None, flag: str = "--tokenizer-dir"
) -> Tokenizer:
    """The tokenizer in directory ``path`` (see the module docstring); one-line errors name ``flag``."""
    p = Path(path)
    if not p.is_dir():
        raise UserError(f"{flag} {p}: not a directory")
    kind = tokenizer_type if tokenizer_type in TOKENIZER_TYPES else _infer_type(p)
    try:
        return build_tokenizer(_config_for(p, str(kind), flag))
    except UserError as exc:
        msg = str(exc)
        raise UserError(msg if msg.startswith(flag) else f"{flag} {p}: {msg}") from None


def checkpoint_tokenizer_dir(root: str | Path) -> Path:
    """Where a checkpoint keeps its tokenizer's files."""
    return Path(root) / TOKENIZER_SUBDIR


def tokenizer_from_record(record: TokenizerRecord, root: str | Path) -> Tokenizer:
    """The tokenizer a checkpoint records, from its ``tokenizer/`` directory (or recorded paths)."""
    here = checkpoint_tokenizer_dir(root)
    if here.is_dir():
        return load_tokenizer_dir(here, tokenizer_type=record.tokenizer_type, flag="checkpoint tokenizer")
    files = [Path(f) for f in record.files if Path(f).is_absolute()]  # earlier checkpoints: absolute paths
    if files and all(f.exists() for f in files):
        cfg = _config_from_paths(record.tokenizer_type, files)
        return build_tokenizer(cfg)
    raise UserError(
        f"{root}: the checkpoint records a {record.tokenizer_type} tokenizer but has no {TOKENIZER_SUBDIR}/ "
        "directory (and its recorded files are gone); pass --tokenizer-dir"
    )


def _config_from_paths(kind: str, files: list[Path]) -> TokenizerConfig:
    by_name = {f.name: f for f in files}
    if kind == "GPT2BPETokenizer":
        vocab = next((f for f in files if f.suffix == ".json"), None)
        merges = next((f for f in files if f.suffix == ".txt"), None)
        return TokenizerConfig(kind, vocab_file=str(vocab), merge_file=str(merges))
    if kind in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        return TokenizerConfig(kind, vocab_file=str(by_name.get("vocab.txt", files[0])))
    return TokenizerConfig(kind, model_path=str(files[0]))


def tokenizer_from_args(args: Mapping[str, Any], *, root: str | Path | None) -> Tokenizer | None:
    """The tokenizer upstream ``args`` name (``tokenizer_type``, ``vocab_file``, ``merge_file``,
    ``tokenizer_model``), files absolute or relative to the checkpoint root; ``None`` when the
    type is not one we build or a file does not exist here."""
    kind = args.get("tokenizer_type")
    if kind not in TOKENIZER_TYPES:
        return None

    def find(key: str) -> str | None:
        value = args.get(key)
        if not isinstance(value, str) or not value:
            return None
        for cand in (Path(value), Path(root or ".") / value):
            if cand.exists():
                return str(cand)
        return "\0missing"

    files = {
        "vocab_file": find("vocab_file"),
        "merge_file": find("merge_file"),
        "model_path": find("tokenizer_model"),
    }
    if any(v == "\0missing" for v in files.values()):
        return None
    try:
        return build_tokenizer(TokenizerConfig(str(kind), **files))
    except UserError:
        return None


def source_files(tok: Tokenizer) -> list[Path]:
    """The files a tokenizer was loaded from (all tokenizer files of a Hugging Face directory)."""
    model_path = getattr(tok, "model_path", None)
    if tok.tokenizer_type == "HuggingFaceTokenizer" and model_path is not None:
        return [Path(model_path) / n for n in HF_TOKENIZER_FILES if (Path(model_path) / n).is_file()]
    names = ("vocab_file", "merge_file", "model_file")
    return [Path(str(getattr(tok, n))) for n in names if getattr(tok, n, None)]


def describe(tok: Tokenizer, files: list[str] | tuple[str, ...]) -> TokenizerRecord:
    """The record of ``tok`` whose files are ``files`` (names inside ``CKPT/tokenizer/``)."""
    return TokenizerRecord(
        tokenizer_type=tok.tokenizer_type,
        files=tuple(files),
        vocab_size=int(tok.vocab_size),
        **tok.special_ids(),
        probe_ids=tuple(int(i) for i in tok.tokenize(PROBE_TEXT)),
    )


def saved_name(tok: Tokenizer, src: Path) -> str:
    """Name of a Megatron tokenizer file inside ``CKPT/tokenizer/`` (what the loader looks for)."""
    if tok.tokenizer_type == "GPT2BPETokenizer":
        return "vocab.json" if src == Path(str(getattr(tok, "vocab_file", ""))) else "merges.txt"
    if tok.tokenizer_type in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        return "vocab.txt"
    if src.suffix == ".model" and tok.tokenizer_type != "HuggingFaceTokenizer":
        return "tokenizer.model"
    return src.name


def record_of(tok: Tokenizer) -> TokenizerRecord:
    """The record of ``tok`` as :func:`save_tokenizer` will save it."""
    if isinstance(tok, HuggingFaceTokenizer):
        return describe(tok, tok.saved_names)
    return describe(tok, [saved_name(tok, f) for f in source_files(tok)])


def _save_hf(tok: HuggingFaceTokenizer, out: Path) -> list[str]:
    """``save_pretrained`` of the resolved tokenizer into ``out`` (atomically, file by file), checked
    to load back as the same tokenizer (vocabulary, special ids, probe encoding, BOS rule)."""
    with tempfile.TemporaryDirectory() as tmp:
        names = tok.save_pretrained(tmp)
        for name in names:
            with open(Path(tmp) / name, "rb") as fin, atomic_open(out / name, "wb") as fout:
                shutil.copyfileobj(fin, fout)
    back = load_tokenizer_dir(out, tokenizer_type=tok.tokenizer_type, flag="saved tokenizer")
    want, got = describe(tok, names), describe(back, names)
    if (got, back.adds_bos) != (want, tok.adds_bos):
        raise UserError(
            f"the Hugging Face tokenizer of {tok.model_path} does not load back as itself from "
            f"{out} (saved: {got}, source: {want}); this tokenizer cannot travel with a checkpoint"
        )
    return names


def save_tokenizer(tok: Tokenizer, dst: str | Path) -> TokenizerRecord:
    """Copy ``tok``'s files into the directory ``dst`` (atomically, file by file); its record.

    A Hugging Face tokenizer is written with ``save_pretrained`` (see :func:`_save_hf`), so that
    the copy resolves to the class ``AutoTokenizer`` chose for the source."""
    out = Path(dst)
    out.mkdir(parents=True, exist_ok=True)
    if isinstance(tok, HuggingFaceTokenizer):
        return describe(tok, _save_hf(tok, out))
    names = []
    for src in source_files(tok):
        name = saved_name(tok, src)
        if src.resolve() != (out / name).resolve():
            with open(src, "rb") as fin, atomic_open(out / name, "wb") as fout:
                shutil.copyfileobj(fin, fout)
        names.append(name)
    if tok.tokenizer_type == "BertWordPieceCase":  # the case rule travels with vocab.txt
        with atomic_open(out / "mlm_tokenizer.json", "w") as fh:
            json.dump({"tokenizer_type": tok.tokenizer_type}, fh)
    return describe(tok, names)


def check_tokenizer(
    tok: Tokenizer,
    *,
    what: str,
    model_vocab: int,
    recorded: TokenizerRecord | None,
    model_source: str,
    force: bool = False,
    divisible_by: int = 128,
) -> list[str]:
    """Refuse ``tok`` (described by ``what``, e.g. ``--tokenizer-dir X``) for a model of
    ``model_vocab`` rows whose checkpoint records ``recorded``; returns the overridden problems
    when ``force`` (for the result record), else raises :class:`UserError` with the first one.

    A tokenizer too small for the rows (:func:`~pretrain.tensor_parallel.vocab.rows_fit_tokenizer`,
    ``divisible_by``: the model's make_vocab_size_divisible_by) is a problem too."""
    from pretrain.tensor_parallel.vocab import rows_fit_tokenizer

    problems = []
    if tok.vocab_size > model_vocab:
        problems.append(
            f"{what} has {tok.vocab_size} tokens but {model_source} only {model_vocab} vocabulary rows"
        )
    elif not rows_fit_tokenizer(tok.vocab_size, model_vocab, divisible_by=divisible_by):
        problems.append(
            f"{what} has {tok.vocab_size} tokens, too few for {model_source}'s {model_vocab} vocabulary "
            "rows (neither Hugging Face's nor Megatron's padding of it)"
        )
    if recorded is not None:
        ours = {k: v for k, v in tok.special_ids().items() if v is not None}
        theirs = {k: v for k, v in recorded.special_ids().items() if v is not None}
        if recorded.vocab_size and tok.vocab_size != recorded.vocab_size:
            problems.append(
                f"{what} has {tok.vocab_size} tokens, {model_source} records a "
                f"{recorded.tokenizer_type} of {recorded.vocab_size}"
            )
        if recorded.vocab_size and ours != theirs:  # earlier records carry no special ids
            problems.append(f"{what} has special ids {ours}, {model_source} records {theirs}")
        probe = tuple(tok.tokenize(PROBE_TEXT))
        if recorded.probe_ids and probe != recorded.probe_ids:
            problems.append(
                f"{what} encodes the probe text as {list(probe[:8])}..., {model_source}'s tokenizer as "
                f"{list(recorded.probe_ids[:8])}..."
            )
    if tok.vocab_size > model_vocab:  # ids past the rows cannot be scored, forced or not
        raise UserError(problems[0])
    if problems and not force:
        raise UserError(f"{problems[0]} (--force-tokenizer uses it anyway)")
    return problems


@dataclass(frozen=True, kw_only=True)
class ResolvedTokenizer:
    """The tokenizer a command uses for a model, where it came from, and what ``--force-tokenizer``
    overrode (empty unless forced; result records list it)."""

    tokenizer: Tokenizer
    source: str
    record: TokenizerRecord
    forced: tuple[str, ...] = ()


def resolve_tokenizer(
    reader: Any,
    *,
    tokenizer_dir: str | Path | None = None,
    given: tuple[Tokenizer, str] | None = None,
    force: bool = False,
    required: bool = True,
    flag: str = "--tokenizer-dir",
) -> ResolvedTokenizer | None:
    """The tokenizer for an opened checkpoint ``reader`` (``spec``, ``info``, ``metadata``, ``args``).

    ``given`` (a tokenizer and the flags that named it) or ``tokenizer_dir`` (a flag) is checked
    against the model and the recorded tokenizer (see :func:`check_tokenizer`); else the recorded one (``CKPT/tokenizer/``), else the one upstream
    ``args`` name when its files exist, else a ``tokenizer/`` directory without a record. None
    found: :class:`UserError` when ``required``, else ``None``.
    """
    meta = getattr(reader, "metadata", None)
    recorded = meta.tokenizer if meta is not None else None
    info = reader.info
    root = Path(info.root or info.path)
    check = functools.partial(check_tokenizer, model_vocab=reader.spec.cfg.vocab_size, force=force,
                              model_source=f"the checkpoint {info.path}",
                              divisible_by=reader.spec.cfg.make_vocab_size_divisible_by)  # fmt: skip
    if given is None and tokenizer_dir is not None:
        given = (load_tokenizer_dir(tokenizer_dir, flag=flag), f"{flag} {tokenizer_dir}")
    if given is not None:
        tok, what = given
        forced = check(tok, what=what, recorded=recorded)
        return ResolvedTokenizer(tokenizer=tok, source=what, record=record_of(tok), forced=tuple(forced))
    if recorded is not None:
        tok = tokenizer_from_record(recorded, root)
        forced = check(tok, what=f"{root / TOKENIZER_SUBDIR}", recorded=recorded)
        return ResolvedTokenizer(tokenizer=tok, source="the checkpoint's tokenizer", record=record_of(tok),
                                 forced=tuple(forced))  # fmt: skip
    found = tokenizer_from_args(getattr(reader, "args", {}) or {}, root=root)
    source = f"args.tokenizer_type {getattr(found, 'tokenizer_type', '')}"
    if found is None and checkpoint_tokenizer_dir(root).is_dir():
        found = load_tokenizer_dir(checkpoint_tokenizer_dir(root), flag="checkpoint tokenizer")
        source = str(checkpoint_tokenizer_dir(root))
    if found is not None:
        forced = check(found, what=source, recorded=None)
        return ResolvedTokenizer(
            tokenizer=found, source=source, record=record_of(found), forced=tuple(forced)
        )
    if required:
        raise UserError(
            f"{info.path}: no usable tokenizer (none recorded in the checkpoint, no {TOKENIZER_SUBDIR}/ "
            f"directory, no tokenizer files named by its args); pass {flag} DIR"
        )
    return None
