"""Golden strings for every WikiText detokenizer rule, their order, and the T_o count."""

from __future__ import annotations

import pytest

from mlm_eval.builtin import builtin_path
from mlm_eval.tasks.detokenize import count_original_tokens, wikitext_detokenize

# One case per rule, in the order the rules are applied; hand-written expected outputs.
RULE_CASES = [
    ("contraction s '", "the players ' union", "the players' union"),
    ("hyphen @-@", "a well @-@ known band", "a well-known band"),
    ("thousands @,@", "1 @,@ 000 people", "1,000 people"),
    ("decimal @.@", "2 @.@ 5 metres", "2.5 metres"),
    ("colon", "note : this", "note: this"),
    ("semicolon", "one ; two", "one; two"),
    ("period", "end . Next", "end. Next"),
    ("exclamation", "stop ! Go", "stop! Go"),
    ("question", "why ? Because", "why? Because"),
    ("comma", "red , green", "red, green"),
    ("parentheses", "a ( b c ) d", "a (b c) d"),
    ("brackets", "a [ b ] d", "a [b] d"),
    ("braces", "a { b } d", "a {b} d"),
    ("double quotes", 'he said " hello there " and', 'he said "hello there" and'),
    ("single quotes", "the ' Blue ' song", "the 'Blue' song"),
    ("level-4 heading", " = = = = Deep = = = = ", " ==== Deep ==== "),
    ("level-3 heading", " = = = Sub = = = ", " === Sub === "),
    ("level-2 heading", " = = Section = = ", " == Section == "),
    ("degree sign", "20 \N{DEGREE SIGN} C", "20\N{DEGREE SIGN}C"),
    ("space before newline", "end\t \nnext", "end\t\nnext"),
    ("space after newline", "end\n\tnext", "end\n\tnext"),
    ("N to 1", "a N b", "a 1 b"),
    ("possessive 's", "John 's hat", "John's hat"),
]


@pytest.mark.parametrize(("name", "raw", "expected"), RULE_CASES, ids=[c[0] for c in RULE_CASES])
def test_each_rule(name: str, raw: str, expected: str) -> None:
    assert wikitext_detokenize(raw) == expected


def test_newline_rules_strip_one_space_each_side() -> None:
    assert wikitext_detokenize("a \n b") == "a\nb"
    assert wikitext_detokenize(" \n = Title = \n \n Text . \n") == "\n= Title =\n\nText.\n"


def test_rule_order_matters() -> None:
    # "s '" runs before the quote-pair rule, so the possessive apostrophe is not taken as a quote.
    assert wikitext_detokenize("the boys ' ball") == "the boys' ball"
    # The punctuation rules need a space after the mark: a final " ." stays (no trailing space).
    assert wikitext_detokenize("end .") == "end ."
    # " @-@ " is replaced before the comma rule, so numbers keep their separators.
    assert wikitext_detokenize("3 @,@ 200 , then") == "3,200, then"
    # "= = = =" is collapsed before "= =" would turn it into "== ==".
    assert wikitext_detokenize("= = = =") == "===="
    # " 's" is last: the quote-pair rule has already consumed "' ... '" spans before it.
    assert wikitext_detokenize("Mary 's and Ann 's") == "Mary's and Ann's"


def test_pairs_are_non_greedy() -> None:
    assert wikitext_detokenize("( a ) and ( b )") == "(a) and (b)"
    assert wikitext_detokenize('" x " y " z "') == '"x" y "z"'


def test_unk_and_plain_text_untouched() -> None:
    assert wikitext_detokenize("a <unk> word") == "a <unk> word"
    assert wikitext_detokenize("") == ""


def test_full_wikitext_line() -> None:
    raw = (
        " = = Route = = \n \n The line ( 42 km ) ran 1 @,@ 200 m , then climbed 3 @.@ 5 % ; it 's steep . \n"
    )
    # The leading space of the first line is not next to a newline, so it stays.
    assert (
        wikitext_detokenize(raw)
        == " == Route ==\n\nThe line (42 km) ran 1,200 m, then climbed 3.5 %; it's steep.\n"
    )


def test_count_original_tokens_known_text() -> None:
    # Stripped, then split on single spaces: each " \n " contributes a "\n" piece.
    text = " \n = Title = \n \n One two , three . \n \n"
    # strip -> "= Title = \n \n One two , three ." -> "=", "Title", "=", "\n", "\n", "One", "two", ",", "three", "."
    assert count_original_tokens(text) == 10
    assert count_original_tokens("a  b") == 3  # a double space gives an empty piece
    assert count_original_tokens("a\nb") == 1  # newlines alone do not split
    assert count_original_tokens("   ") == 1  # "".split(" ") == [""]


def test_count_original_tokens_counts_before_detokenizing() -> None:
    raw = builtin_path("wikitext_sample.tokens").read_text(encoding="utf-8")
    assert " @-@ " in raw and " @,@ " in raw and "<unk>" in raw
    assert count_original_tokens(raw) == len(raw.strip().split(" "))
    # Detokenizing removes many spaces, so counting afterwards would give a smaller, wrong T_o.
    assert count_original_tokens(wikitext_detokenize(raw)) < count_original_tokens(raw)
