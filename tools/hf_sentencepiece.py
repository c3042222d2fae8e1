"""A SentencePiece BPE model as a Hugging Face ``LlamaTokenizer`` (``tokenizer.json``), for
``mlm-convert to-hf`` of Megatron's ``Llama2Tokenizer`` / ``GPTSentencePieceTokenizer``.

transformers 5 converts SentencePiece files through protobuf; this reads the pieces with the
``sentencepiece`` library instead (ids unchanged, merges from the piece order as transformers
does). The result encodes text as the SentencePiece model does, except where the two libraries
differ for every Llama model: a text that *starts* with a space, and the literal text of a
special piece (``<unk>``), which Hugging Face reads as that token. :func:`hf_tokenizer_of` checks
the probe text before anything is written.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import LlamaTokenizer


def llama_tokenizer_from_sentencepiece(model_file: str, *, add_bos: bool) -> LlamaTokenizer:
    """A ``transformers.LlamaTokenizer`` over the pieces of ``model_file`` (a BPE ``.model``);
    ``add_bos``: encoding with special tokens puts ``<s>`` first (Llama's convention)."""
    import sentencepiece
    from transformers import LlamaTokenizer
    from transformers.tokenization_utils_base import generate_merges

    sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
    vocab = {str(sp.id_to_piece(i)): i for i in range(sp.get_piece_size())}
    ids = {
        "unk_token": sp.unk_id(),
        "bos_token": sp.bos_id(),
        "eos_token": sp.eos_id(),
        "pad_token": sp.pad_id(),
    }
    special = {name: str(sp.id_to_piece(i)) for name, i in ids.items() if i >= 0}
    return LlamaTokenizer(
        vocab=vocab, merges=generate_merges(vocab), legacy=True, add_bos_token=add_bos, add_eos_token=False,
        clean_up_tokenization_spaces=False, **special,
    )  # fmt: skip
