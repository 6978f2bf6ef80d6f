"""Choosing an operating point: per-unit sensitivity and a mixed-precision search under a quality budget.

A floor above evals: it uses the models, the quantization math and the eval statistics; nothing below imports it.
"""
