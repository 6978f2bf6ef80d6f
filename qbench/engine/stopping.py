"""When a sequence is done: EOS, a stop string, max_new_tokens, or the context window."""

from __future__ import annotations

from typing import Callable

from qbench.engine.sequence import Sequence


def check_finished(s: Sequence, tok: int, eos_ids: set[int], max_positions: int,
                   detokenize: Callable[[list[int]], str] | None) -> None:
    """Set ``s.finish_reason`` (and ``s.text``) after ``tok`` was appended."""
    p = s.params
    if tok in eos_ids and not p.ignore_eos:
        s.finish_reason = "eos"
    elif p.stop and detokenize is not None:
        s.text = detokenize(s.output_ids)
        hits = [i for i in (s.text.find(x) for x in p.stop) if i >= 0]
        if hits:
            s.text = s.text[: min(hits)]
            s.finish_reason = "stop"
    if s.finish_reason is None:
        if len(s.output_ids) >= p.max_new_tokens:
            s.finish_reason = "length"
        elif len(s) >= max_positions:
            s.finish_reason = "context"
    if s.finish_reason and s.finish_reason != "stop" and detokenize is not None:
        s.text = detokenize(s.output_ids)
