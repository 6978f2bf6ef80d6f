"""The eval registry: task name -> an object with a ``Config`` dataclass and ``run(subject, cfg, ctx)``."""

from __future__ import annotations

from qbench.evals import custom, gsm8k, kld, needle, perplexity, speed

TASKS = {"kld": kld, "perplexity": perplexity, "gsm8k": gsm8k.TASK, "gsm8k_cot": gsm8k.COT_TASK, "needle": needle, "custom": custom,
         "speed": speed}
