"""Benchmarks: ours against a baseline side by side in one run; last line is one JSON object."""
