"""Tensor code. Models wire these together; nothing here knows about a model family."""
