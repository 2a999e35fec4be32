"""The trainer's stop-on-signal flag: one event per burst of repeated signals (a dying launcher's
kernel sends the parent-death signal once per reparenting), a later repeat stops at once."""

import os
import signal
import time

import pytest

from megatron_dppo import trainer


def test_a_burst_of_sigterms_is_one_request(capfd):
    before = signal.getsignal(signal.SIGTERM)
    with trainer._stop_on_signals() as flag:
        for _ in range(3):  # as the kernel does when a multi-threaded launcher is killed
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.01)
        assert flag.requested and flag.name == "SIGTERM"
    assert capfd.readouterr().err.count("SIGTERM received") == 1
    assert signal.getsignal(signal.SIGTERM) is before  # the previous handler is back


def test_a_later_repeat_stops_at_once(monkeypatch):
    monkeypatch.setattr(trainer, "_REPEAT_WINDOW_S", 0.05)
    with pytest.raises(KeyboardInterrupt), trainer._stop_on_signals() as flag:
        os.kill(os.getpid(), signal.SIGINT)
        assert flag.requested and flag.name == "SIGINT"
        time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)  # the handler runs between bytecodes: the interrupt comes here
