"""Supervised fine-tuning (SFT) of decoders: ``mlm-finetune sft``.

One concept per module: :mod:`.records` reads the JSONL, :mod:`.template` finds the chat
template, :mod:`.masks` renders a conversation into token ids and its loss mask, :mod:`.samples`
turns records into (tokens, labels, loss mask) samples with truncation counted, :mod:`.packing`
lays samples into fixed-length rows (padded or packed), :mod:`.source` loads the decoder to start
from, :mod:`.task` plugs SFT into the one training loop and computes ``valid_loss``, :mod:`.cli`
is the command and :mod:`.tiny_tokenizer` builds the offline demo tokenizer.
"""
