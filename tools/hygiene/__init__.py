"""Helpers for the data-hygiene tools (``mlm-dedup``, ``mlm-filter``)."""
