"""qbench: a quantization workbench for causal LMs on the CPU."""

__version__ = "0.1.0"
