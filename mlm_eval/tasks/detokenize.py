"""The WikiText detokenizer of the paper (appendix E.1) and the original-token count T_o.

WikiText-103 ships pre-tokenized (``a @-@ b``, ``word , word``, ``( x )``, `` = = Heading = = ``);
the paper undoes these artifacts before subword tokenization, but normalises the loss by the number
of *original* tokens T_o, counted on the raw text before detokenizing.

The rules are Megatron-LM's ``wikitext_detokenizer`` (``tasks/zeroshot_gpt/detokenizer.py``),
applied in this order. lm-evaluation-harness's ``preprocess_wikitext.wikitext_detokenizer`` is
the same function, rule for rule, so both evaluation methods share it. Both upstream copies also
carry ``re.sub(r"/' [0-9]/", r"/'[0-9]/", s)``, a regex written with JavaScript-style slashes
that only matches the literal text ``/' 7/`` and then writes ``/'[0-9]/``; it is not one of the
paper's rules and is left out (no WikiText text contains ``/'``).
"""

from __future__ import annotations

import re

# (pattern, replacement) pairs, applied in order; plain strings use str.replace.
_CONTRACTION = [("s '", "s'")]
_NUMBER_SEPARATORS = [(" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", ".")]
_PUNCTUATION = [(" : ", ": "), (" ; ", "; "), (" . ", ". "), (" ! ", "! "), (" ? ", "? "), (" , ", ", ")]
# Strip the spaces just inside a bracket or quote pair; non-greedy so pairs never merge.
_PAIRS = [
    (re.compile(r"\(\s*([^\)]*?)\s*\)"), r"(\1)"),
    (re.compile(r"\[\s*([^\]]*?)\s*\]"), r"[\1]"),
    (re.compile(r"{\s*([^}]*?)\s*}"), r"{\1}"),
    (re.compile(r"\"\s*([^\"]*?)\s*\""), r'"\1"'),
    (re.compile(r"'\s*([^']*?)\s*'"), r"'\1'"),
]
_MISC = [
    ("= = = =", "===="),
    ("= = =", "==="),
    ("= =", "=="),
    (" \N{DEGREE SIGN} ", "\N{DEGREE SIGN}"),
    (" \n", "\n"),
    ("\n ", "\n"),
    (" N ", " 1 "),
    (" 's", "'s"),
]


def wikitext_detokenize(text: str) -> str:
    """Undo WikiText's tokenization artifacts (the paper's invertible detokenizer)."""
    for old, new in _CONTRACTION + _NUMBER_SEPARATORS + _PUNCTUATION:
        text = text.replace(old, new)
    for pattern, repl in _PAIRS:
        text = pattern.sub(repl, text)
    for old, new in _MISC:
        text = text.replace(old, new)
    return text


def count_original_tokens(raw_text: str) -> int:
    """T_o: the pieces of the raw (not detokenized) text split on single spaces.

    This is Megatron-LM's ``len(entire_data.strip().split(" "))`` (``tasks/zeroshot_gpt``): the
    text is stripped of leading/trailing whitespace, then split on every single space. In the
    WikiText file format every line reads `` w1 w2 ... wn \n`` (a leading space, a trailing
    `` \n``), so each newline becomes a piece of its own and stands in for the end-of-line token
    of word-level WikiText; runs of spaces would give empty pieces (the format has none). The
    paper reports T_o = 245566 for the real WikiText-103 test file (``wiki.test.tokens``) with
    this count (and T = 270329 GPT-2 tokens after detokenizing).
    """
    return len(raw_text.strip().split(" "))
