"""One error type for everything a user can get wrong.

The CLI prints ``QBenchError`` as a single line (what, where, how to fix) and exits
non-zero; anything else is a bug and keeps its traceback under ``--debug``.
"""


class QBenchError(Exception):
    """A user-facing error: the message is one line that says what to do."""

    exit_code = 2
