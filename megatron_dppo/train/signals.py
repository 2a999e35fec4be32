"""SIGTERM / SIGINT during training: finish the step in progress, save, exit non-zero; a second
signal stops at once. What SLURM and torchrun send before a kill is SIGTERM. After the loop failed,
a signal no longer ends the process before its error is shown (_while_reporting_an_error)."""

from __future__ import annotations

import os
import signal
import time
from contextlib import contextmanager

from megatron_dppo.run.process import rank_prefix


class StopRequested(Exception):
    """SIGTERM / SIGINT arrived: the loop saves a checkpoint and exits non-zero."""


class StopNow(StopRequested):
    """The signal came again: stop at once, without saving the step in progress."""


class SignalFlag:
    def __init__(self):
        self.requested, self.name, self.at = False, "", 0.0


# A repeat within this many seconds is the same event: when a launcher dies, the kernel sends the
# parent-death signal again each time it hands the rank to another of the dying launcher's threads
# (seen here: a second SIGTERM right after the first, and rank 0 stopped without saving): that
# must not count as "send it again".
REPEAT_WINDOW_S = 2.0


@contextmanager
def stop_on_signals():
    """SIGTERM and SIGINT set a flag; the loop finishes the step in progress, saves a checkpoint
    and exits non-zero. A second signal (later than REPEAT_WINDOW_S) stops at once."""
    flag = SignalFlag()

    def handler(signum, frame):
        now = time.monotonic()
        if flag.requested:
            if now - flag.at > REPEAT_WINDOW_S:
                os.write(2, f"{rank_prefix()}{flag.name} again: stopping now, without saving this step\n".encode())
                raise StopNow(flag.name)
            return
        flag.requested, flag.name, flag.at = True, signal.Signals(signum).name, now
        # os.write, not print: a handler that prints while the main code is printing raises
        # "reentrant call" inside whatever the step was doing.
        msg = f"{rank_prefix()}{flag.name} received: finishing the current step, then saving a checkpoint"
        os.write(2, (msg + " (send it again to stop at once)\n").encode())

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    failed = True
    try:
        yield flag
        failed = False
    except StopRequested:
        failed = False
        raise
    finally:
        after = _reporting_handler() if failed and "RANK" in os.environ else None
        for s, h in previous.items():
            signal.signal(s, after or h)


def _reporting_handler():
    """-> the handler for a rank of a launched job whose loop failed: its error is shown once the
    trainer is closed, and the launcher sends SIGTERM as soon as another rank ended by the same fault
    (a rollout rank killed): dying of it would lose the error. The signal is said and the exit goes on;
    the signal again (later than REPEAT_WINDOW_S) exits at once."""
    first = SignalFlag()

    def handler(signum, frame):
        now, name = time.monotonic(), signal.Signals(signum).name
        if not first.requested:
            first.requested, first.at = True, now
            os.write(
                2, f"{rank_prefix()}{name} received while stopping on an error: exiting once it is shown\n".encode()
            )
        elif now - first.at > REPEAT_WINDOW_S:
            os.write(2, f"{rank_prefix()}{name} again: exiting now\n".encode())
            os._exit(128 + signum)

    return handler
