"""train/rollout_mail.py: a rollout rank's requests taken in order with the weights staged by a
thread (one copy at a time), its replies sent by another, and a broken bridge named at the next
take or put."""

import threading
import time

import pytest

from megatron_dppo.run.bridge import BridgeBroken, StreamCount
from megatron_dppo.train.rollout_mail import Inbox, Outbox, TrainingRanksGone


class Control:
    """The control bridge's receiving side: the requests, then BridgeBroken (or blocks forever)."""

    def __init__(self, requests, then_broken=False):
        self.requests, self.then_broken = list(requests), then_broken

    def broadcast_object(self):
        if self.requests:
            return self.requests.pop(0)
        if self.then_broken:
            raise BridgeBroken("gone")
        threading.Event().wait()


class Weights:
    """The weights bridge: one bucket per sync, and which syncs were read."""

    def __init__(self):
        self.read = []

    def receive_buckets(self, count: StreamCount):
        self.read.append(len(self.read) + 1)
        count.add([("w", "float32", (1,))])
        yield [("w", None)]
        count.ended = True


def _wait_until(cond, seconds=5.0):
    t0 = time.monotonic()
    while not cond() and time.monotonic() - t0 < seconds:
        time.sleep(0.01)
    return cond()


def test_requests_come_in_order_and_a_second_sync_waits_for_the_first_to_be_loaded():
    weights = Weights()
    requests = [("weights", 1), ("wave", "a"), ("weights", 2), ("wave", "b"), ("stop", None)]
    inbox = Inbox(Control(requests), weights)
    kind, (version, staged) = inbox.take()
    assert (kind, version, staged.count.ended) == ("weights", 1, True)
    assert inbox.take() == ("wave", "a")
    time.sleep(0.2)
    assert weights.read == [1]  # the second sync waits: one staged copy at a time
    inbox.loaded()
    assert _wait_until(lambda: weights.read == [1, 2])
    kind, (version, _) = inbox.take()
    assert (kind, version) == ("weights", 2)
    assert inbox.take() == ("wave", "b") and inbox.take() == ("stop", None)


def test_a_broken_control_bridge_is_training_ranks_gone_at_the_next_take():
    inbox = Inbox(Control([("wave", "a")], then_broken=True), Weights())
    assert inbox.take() == ("wave", "a")
    with pytest.raises(TrainingRanksGone, match="the training ranks went away without saying stop"):
        inbox.take()


class Replies:
    def __init__(self, fail_at=None):
        self.sent, self.fail_at = [], fail_at

    def gather_objects(self, obj):
        if self.fail_at is not None and len(self.sent) == self.fail_at:
            raise BridgeBroken("gone")
        self.sent.append(obj)


def test_replies_go_out_in_order_and_a_broken_bridge_is_named_at_the_next_put():
    replies = Replies()
    outbox = Outbox(replies)
    for r in range(5):
        outbox.put(r)
    outbox.close()
    assert replies.sent == [0, 1, 2, 3, 4]

    outbox = Outbox(Replies(fail_at=1))
    outbox.put("a")
    outbox.put("b")
    assert _wait_until(lambda: outbox.error is not None)
    with pytest.raises(TrainingRanksGone):
        outbox.put("c")
