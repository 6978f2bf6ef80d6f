"""Weight quantization: pure tensor math (primitives), algorithms (rtn, awq, gptq), runtime modules
(qlinear), recipes, and the artifact that records all of it."""
