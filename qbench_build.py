"""Build hooks: ship ``qbench-lm-eval.pth`` at the top of site-packages (see qbench/lm_eval_hook.py),
so that ``lm_eval --model qbench`` works after ``pip install .`` and ``pip install -e .`` alike."""

import shutil
from pathlib import Path

from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = Path(__file__).parent / "qbench-lm-eval.pth"


class BuildPy(build_py):
    def run(self):
        super().run()
        self.copy_file(str(PTH), str(Path(self.build_lib) / PTH.name))

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [str(Path(self.build_lib) / PTH.name)]


class EditableWheel(editable_wheel):
    # An editable wheel carries only the link to the source tree plus whatever lies in its unpacked
    # folder; put the .pth there (setuptools' own hook point for extra top-level files).
    def _run_build_commands(self, dist_name, unpacked_wheel, build_lib, tmp_dir):
        out = super()._run_build_commands(dist_name, unpacked_wheel, build_lib, tmp_dir)
        shutil.copy(PTH, Path(unpacked_wheel) / PTH.name)
        return out
