"""The trainer's stop-on-signal flag: one event per burst of repeated signals (a dying launcher's
kernel sends the parent-death signal once per reparenting), a later repeat stops at once."""

import os
import signal
import time

import pytest

from megatron_dppo.train import signals, trainer


def test_a_burst_of_sigterms_is_one_request(capfd):
    before = signal.getsignal(signal.SIGTERM)
    with signals.stop_on_signals() as flag:
        for _ in range(3):  # as the kernel does when a multi-threaded launcher is killed
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.01)
        assert flag.requested and flag.name == "SIGTERM"
    assert capfd.readouterr().err.count("SIGTERM received") == 1
    assert signal.getsignal(signal.SIGTERM) is before  # the previous handler is back


def test_a_later_repeat_stops_at_once(monkeypatch, capfd):
    monkeypatch.setattr(signals, "REPEAT_WINDOW_S", 0.05)
    with pytest.raises(signals.StopNow), signals.stop_on_signals() as flag:
        os.kill(os.getpid(), signal.SIGINT)
        assert flag.requested and flag.name == "SIGINT"
        time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)  # the handler runs between bytecodes: the interrupt comes here
    assert "SIGINT again: stopping now" in capfd.readouterr().err


@pytest.mark.parametrize("name,status", [("SIGTERM", 143), ("SIGINT", 130)])
def test_any_number_of_signals_exits_with_that_signals_status(monkeypatch, name, status):
    """However many signals arrive (saved after the step, or stopped at once), the exit status is
    128 + the signal's number, as a scheduler expects: never the 130 of a Ctrl-C for a SIGTERM."""
    from megatron_dppo import cli

    closed = []
    for stop in (signals.StopRequested(name), signals.StopNow(name)):

        class Stopping:
            def __init__(self, *a, stop=stop, **k):
                self.stop = stop

            def train(self):
                raise self.stop

            def close(self, stop_rollout_ranks=True):
                closed.append(stop_rollout_ranks)

        monkeypatch.setattr(trainer, "Trainer", Stopping)
        config = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "tiny", "addition.yaml")
        assert cli.main(["train", "--config", config]) == status
    # a second signal stops at once: the trainer does not wait for dedicated rollout ranks' work in flight
    assert closed == [True, False]
