"""Makes multiprocessing's forkserver ignore SIGTERM (worker.protect_forkserver says why).

The forkserver imports its preload modules inside `multiprocessing.forkserver.main`, before it
serves; this module acts only when `main` is on the stack (the forkserver, or a worker forked from
it, which ignores SIGTERM anyway), so that importing it anywhere else (a test, a linter, a doc
tool) cannot make a trainer ignore SIGTERM.
"""

import signal
import sys


def _imported_by_forkserver_main() -> bool:
    from multiprocessing import forkserver

    frame = sys._getframe()
    while frame is not None:
        if frame.f_code is forkserver.main.__code__:
            return True
        frame = frame.f_back
    return False


if _imported_by_forkserver_main():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
