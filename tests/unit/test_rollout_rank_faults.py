"""Dedicated rollout ranks' failure paths (issue 43), their pieces on their own: training rank 0's
stop that waits for nobody (a start-up failure) and the rollout rank's watch for it; the line that
names a rollout rank gone mid-run and what --resume would continue from; a rank that keeps its
error on the screen when the launcher's SIGTERM comes; a damaged pending_rollout.json named. The
processes themselves: tests/e2e/test_rollout_ranks.py."""

import json
import os
import signal
import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from megatron_dppo.megatron.checkpoint import CheckpointError, read_pending_rollout
from megatron_dppo.run import process
from megatron_dppo.run.bridge import BridgeBroken
from megatron_dppo.train import rollout_rank, signals


def _store():
    return dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=10), wait_for_workers=False)


def test_a_stop_left_in_the_store_reaches_the_rollout_rank_at_once():
    """Training rank 0 cannot broadcast a stop to a rollout rank still starting (or sending its
    start-up report): it leaves it in the bridge's store, where the rank's watch finds it."""
    server = _store()
    heard = []
    got = threading.Event()
    done = rollout_rank.watch_for_stop(
        dist.PrefixStore("ctl/", server), lambda why: (heard.append(why), got.set()), 0.05
    )
    try:
        assert not got.wait(0.3)  # nothing said: nothing heard
        t0 = time.monotonic()
        rollout_rank.stop_without_waiting(SimpleNamespace(store=dist.PrefixStore("ctl/", server)), "start-up failed")
        assert got.wait(5) and time.monotonic() - t0 < 2
        assert heard == ["start-up failed"]
    finally:
        done.set()


def test_a_stop_heard_is_said_and_ends_the_process(monkeypatch, capfd):
    exits = []
    monkeypatch.setattr(os, "_exit", exits.append)
    monkeypatch.setattr(process, "_RANK_NAME", [])
    process.set_rank_name("rank 3 (rollout rank 1)")
    rollout_rank._exit_on_stop("training rank 0 stopped during start-up (its error says why)", [])
    rollout_rank._exit_on_stop("same", [signal.SIGTERM])  # a SIGTERM came meanwhile: 128 + 15
    err = capfd.readouterr().err
    assert err.splitlines()[0] == (
        "[rank 3 (rollout rank 1)] training rank 0 stopped during start-up (its error says why): "
        "this rollout rank exits"
    )
    assert exits == [0, 143]


def test_the_store_that_is_gone_leaves_the_stop_unsaid():
    class Gone:
        def set(self, key, value):
            raise RuntimeError("Connection reset by peer")

    rollout_rank.stop_without_waiting(SimpleNamespace(store=Gone()), "why")  # no error: nothing more to do


def _roles(train_ranks, rollout_ranks):
    return SimpleNamespace(train_ranks=train_ranks, rollout_ranks=rollout_ranks)


def test_a_rollout_rank_gone_is_named_with_what_resume_continues_from(tmp_path):
    ckpt = tmp_path / "checkpoints"
    (ckpt / "step_000004").mkdir(parents=True)
    (ckpt / "latest").write_text("step_000004\n")
    assert rollout_rank.rollout_ranks_gone_line(_roles(1, 1), 5, str(ckpt)) == (
        "rank 1 (rollout rank 0) went away during step 5 (killed, or it failed: see its output): no checkpoint "
        f"saved for step 5; the last is step 4, {ckpt / 'step_000004'} (--resume continues from it)"
    )
    line = rollout_rank.rollout_ranks_gone_line(_roles(4, 2), 2, str(tmp_path / "none"))
    assert line.startswith("one of ranks 4-5 (rollout ranks) went away during step 2 ")
    assert line.endswith(
        f"no checkpoint saved for step 2; none was saved before it either (none under {tmp_path / 'none'}): "
        "--resume has nothing to continue from"
    )


def test_only_a_broken_bridge_is_reported_as_a_rollout_rank_gone(tmp_path):
    watchdog = SimpleNamespace(step=7)
    with pytest.raises(rollout_rank.RolloutRanksGone, match=r"^rank 2 \(rollout rank 0\) went away during step 7 "):
        with rollout_rank.reporting_rollout_ranks_gone(_roles(2, 1), watchdog, str(tmp_path)):
            raise BridgeBroken("a member of the bridge went away")
    with pytest.raises(RuntimeError, match="^something else$"):  # a training rank's own failure stays its own
        with rollout_rank.reporting_rollout_ranks_gone(_roles(2, 1), watchdog, str(tmp_path)):
            raise RuntimeError("something else")


def test_a_launched_rank_that_failed_keeps_its_error_through_the_launchers_sigterm(monkeypatch, capfd):
    """torchrun sends SIGTERM to every rank as soon as one ended (a killed rollout rank): a training
    rank unwinding from the same fault must not die of it before its error is shown."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(signals, "REPEAT_WINDOW_S", 0.05)
    seen = []
    saved = {s: signal.signal(s, lambda signum, frame: seen.append(signum)) for s in (signal.SIGTERM, signal.SIGINT)}
    exits = []
    monkeypatch.setattr(os, "_exit", exits.append)
    try:
        with pytest.raises(RuntimeError), signals.stop_on_signals():
            raise RuntimeError("the loop failed")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        assert seen == [] and exits == []  # the error is still to be shown
        os.kill(os.getpid(), signal.SIGTERM)  # again, later than the window: now
        time.sleep(0.2)
        assert exits == [143]
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
    err = capfd.readouterr().err
    assert "SIGTERM received while stopping on an error: exiting once it is shown" in err
    assert "SIGTERM again: exiting now" in err


def test_a_finished_or_unlaunched_loop_gives_the_previous_handlers_back(monkeypatch):
    mine = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        with signals.stop_on_signals():
            pass
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        monkeypatch.delenv("RANK", raising=False)  # a Trainer used as a library: its process is its user's
        with pytest.raises(RuntimeError), signals.stop_on_signals():
            raise RuntimeError("failed")
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, mine)


def test_a_damaged_pending_rollout_names_its_file(tmp_path):
    """The manifest checks its size only: bytes garbled in place were json's "Expecting value: line 1
    column 4998" with no file named, after the model had loaded."""
    path = tmp_path / "pending_rollout.json"
    assert read_pending_rollout(str(tmp_path)) is None  # a save at max_staleness=0 has none
    path.write_text(json.dumps({"step": 2, "round": [1, 2, 3]}))
    assert read_pending_rollout(str(tmp_path)) == {"step": 2, "round": [1, 2, 3]}
    raw = bytearray(path.read_bytes())
    raw[10:16] = b"#garb#"
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError) as e:
        read_pending_rollout(str(tmp_path))
    assert str(e.value).startswith(f"{path} is not valid JSON (")
    assert "the file is damaged (the next step's rollout, saved at trainer.max_staleness=1)" in str(e.value)
    path.write_bytes(b'{"step": "\xff"}')  # not UTF-8
    with pytest.raises(CheckpointError, match="is not valid JSON"):
        read_pending_rollout(str(tmp_path))
    path.write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="expected a JSON object"):
        read_pending_rollout(str(tmp_path))
