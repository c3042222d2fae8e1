"""Rank layout (pure functions) and the :class:`ParallelState` holding process groups."""
