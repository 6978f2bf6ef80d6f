"""Native CPU kernels, compiled on first use with the system C compiler and loaded with ctypes.

They are optional: without a compiler, or on a CPU without AVX2/FMA, every layer falls
back to a torch path (``available()`` is False), and the golden tests still check it.
"""
