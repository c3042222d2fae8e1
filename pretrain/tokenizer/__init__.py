"""Tokenizers behind one small interface (:class:`Tokenizer`), built from Megatron's flags.

>>> cfg = TokenizerConfig("GPT2BPETokenizer", vocab_file="vocab.json", merge_file="merges.txt")
>>> tok = build_tokenizer(cfg)  # doctest: +SKIP
>>> tok.detokenize(tok.tokenize("hello world"))  # doctest: +SKIP
'hello world'
"""

from pretrain.tokenizer.base import Tokenizer
from pretrain.tokenizer.factory import TOKENIZER_TYPES, TokenizerConfig, build_tokenizer
from pretrain.tokenizer.flags import add_tokenizer_arguments

__all__ = ["TOKENIZER_TYPES", "Tokenizer", "TokenizerConfig", "add_tokenizer_arguments", "build_tokenizer"]
