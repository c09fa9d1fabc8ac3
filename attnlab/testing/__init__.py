"""Helpers for tests, the project's and a user's own: a tiny word-level corpus and the arguments of a debug-size
run on it (``tiny_runs``)."""
