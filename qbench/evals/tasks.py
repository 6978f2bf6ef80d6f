"""The eval registry: task name -> its module (a ``Config`` dataclass and ``run(subject, cfg, ctx)``)."""

from __future__ import annotations

from qbench.evals import kld, perplexity

TASKS = {"kld": kld, "perplexity": perplexity}
