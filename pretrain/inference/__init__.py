"""Incremental text generation: key/value cache, sampling, and the TP/PP-aware decoding loop."""
