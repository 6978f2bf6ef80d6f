"""One bench case in a fresh spawned process, so its peak RSS is its own and a peer that crashes is
reported instead of hanging the run."""

from __future__ import annotations

import multiprocessing as mp


class CaseCrashed(RuntimeError):
    pass


def run_isolated(fn, case: dict) -> dict:
    """fn(case) in a fresh spawned process; its exception is raised here. A process that dies (a peer's
    native code segfaulting, say) raises CaseCrashed instead of hanging, as multiprocessing.Pool.apply would."""
    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(fn, case, send))
    proc.start()
    send.close()  # only the child holds the write end now, so its death ends recv() with EOFError
    try:
        ok, value = recv.recv()
    except EOFError:
        proc.join()
        code = proc.exitcode
        raise CaseCrashed("the process running it died (" + (f"signal {-code}" if code and code < 0 else
                                                              f"exit code {code}") + ")") from None
    proc.join()
    if not ok:
        raise value
    return value


def _child(fn, case, conn) -> None:
    try:
        conn.send((True, fn(case)))
    except BaseException as e:  # noqa: BLE001 - handed to the parent, which raises it
        conn.send((False, e))
