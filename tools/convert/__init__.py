"""``mlm-convert``'s commands, one module each; :mod:`tools.convert.cli` parses and dispatches."""
