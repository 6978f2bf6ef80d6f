"""Makes ``lm_eval --model qbench`` work: lm-eval has no plugin entry point for models.

The installed ``qbench-lm-eval.pth`` imports this module at interpreter start. It costs one small
import finder and nothing else: the moment lm-eval imports its model table (``lm_eval.models``),
"qbench" is added to lm-eval's registry as a lazy name, and ``qbench.evals.lm_eval_model`` (torch,
the engine) is imported only if lm-eval is asked for that model.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

TARGET = "qbench.evals.lm_eval_model:QBenchLM"


def register() -> None:
    from lm_eval.api.registry import model_registry
    if "qbench" not in model_registry:
        model_registry.register("qbench", target=TARGET)


class _AfterLmEvalModels(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "lm_eval.models":
            return None
        sys.meta_path.remove(self)  # once; find_spec below must not find this finder again
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            register()

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    if not any(isinstance(f, _AfterLmEvalModels) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterLmEvalModels())


install()
