"""The shipped GSM8K files for lm-eval, found from this file so that lm-eval runs from any directory."""

from pathlib import Path

import datasets

DATA = Path(__file__).resolve().parents[2] / "data" / "gsm8k"


def load(**_):
    files = {"train": str(DATA / "train.jsonl"), "test": str(DATA / "test.jsonl")}
    return datasets.load_dataset("json", data_files=files)
