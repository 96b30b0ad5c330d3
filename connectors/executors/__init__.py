"""Executors: the consumers that run a run's effects (model calls, tool calls) and commit their
results back."""
