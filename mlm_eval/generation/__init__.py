"""``mlm-generate``: text generation from a checkpoint of any layout (:mod:`.cli`, KV-cache decoding
in :mod:`pretrain.inference`) or from a Hugging Face model with the same flags (:mod:`.hf`); both
print through :mod:`.stream` (stop strings, streaming text).
"""
