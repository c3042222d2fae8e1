"""Small shared utilities (errors, atomic files, result records)."""
