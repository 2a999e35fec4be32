"""A rollout rank's two mail threads, so that its engine never waits for the trainer's calls and the
trainer never waits for a generation to end before it can send (trainer.max_staleness = k):

  * `Inbox`: a thread that takes training rank 0's requests off the control bridge as they come,
    and the weights that follow a "weights" / "adapters" request off the weights bridge, read to
    the stream's end marker into host memory (a staged copy). The main thread takes them in the
    order they were sent. One staged copy at most: the thread reads the next weights only once the
    main thread has loaded the last (a trainer that runs further ahead waits in its push).
  * `Outbox`: a thread that sends the main thread's replies on the replies bridge, in order, while
    the main thread goes on to the next request.

Both bridges' calls stay in one order on every member (each group is used by one thread on each
side). A bridge that breaks (the training ranks are gone) reaches the main thread as
TrainingRanksGone at its next take or put.

Why by hand: vLLM's async engine would let one process generate and receive at once, but the
weights arrive over our own process-group bridge (run/bridge.py), which has no callback API; two
threads and two queues are the smallest thing that lets the bridge calls and generation overlap.
"""

from __future__ import annotations

import queue
import threading
from collections import deque

from megatron_dppo.run.bridge import BridgeBroken, StreamCount, WeightStreamError

POLL_S = 1.0  # how often a blocked take looks at its thread's error (signals are handled meanwhile)


class TrainingRanksGone(RuntimeError):
    """The bridge to training rank 0 broke before it said stop (it crashed or was killed)."""


GONE = "the training ranks went away without saying stop (see their output): this rollout rank exits"


def _gone_or(e: BaseException) -> BaseException:
    return TrainingRanksGone(GONE) if isinstance(e, BridgeBroken) else e


class StagedWeights:
    """One weight sync read to its end marker: the buckets (views of their received buffers) and
    the stream's count."""

    def __init__(self, buckets: list, count: StreamCount):
        self.buckets, self.count = buckets, count


def receive_weights(weights) -> StagedWeights:
    """Every bucket of one weight sync from the weights bridge: receive_buckets, read through, ends
    only at the stream's end marker (or raises WeightStreamError)."""
    count = StreamCount()
    return StagedWeights(list(weights.receive_buckets(count)), count)


def receive_adapters(weights) -> dict:
    """One LoRA adapter sync from the weights bridge (one bucket) -> {HF name: tensor}."""
    return {name: t.clone() for bucket in receive_weights(weights).buckets for name, t in bucket}


def load_staged_weights(engine, staged: StagedWeights, version: int) -> StreamCount:
    """Load a staged sync into the engine and check that the engine read every bucket: one that
    returned early would sample with weights of two versions."""
    read = StreamCount()

    def buckets():
        for bucket in staged.buckets:
            read.add([(name, None, None) for name, _ in bucket])
            yield bucket
        read.ended = True

    engine.load_weights(buckets())
    if not read.ended:
        after = (
            f"after {read.buckets} bucket(s), {read.tensors} tensor(s), the last {read.last!r}"
            if read.buckets
            else "before its first bucket"
        )
        raise WeightStreamError(
            f"rollout rank: the engine's load of step {version}'s weights returned {after}, before the weights "
            "bridge's end marker: its weights mix two versions"
        )
    return staged.count


class Inbox:
    """The requests of training rank 0, in order, with each sync's weights staged (module docstring).
    take() -> (kind, payload); for "weights" the payload is (version, StagedWeights), for "adapters"
    (version, {HF name: tensor}); call loaded() once they are in the engine. take_sync() takes a
    staged sync out of turn (partial rollouts: new weights load between chunks of a round)."""

    SYNCS = ("weights", "adapters")

    def __init__(self, control, weights):
        self.control, self.weights = control, weights
        self.items: deque = deque()
        self.arrived = threading.Condition()
        self.slot = threading.Semaphore(1)  # one staged copy of the weights at a time
        self.thread = threading.Thread(target=self._run, name="rollout-inbox", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while True:
                kind, payload = self.control.broadcast_object()
                if kind == "weights":
                    self.slot.acquire()
                    payload = (payload, receive_weights(self.weights))
                elif kind == "adapters":
                    self.slot.acquire()
                    payload = (payload, receive_adapters(self.weights))
                self._put((kind, payload))
                if kind == "stop":
                    return
        except BaseException as e:  # noqa: BLE001 - the main thread raises it at its next take
            self._put(("error", _gone_or(e)))

    def _put(self, item) -> None:
        with self.arrived:
            self.items.append(item)
            self.arrived.notify()

    def take(self):
        with self.arrived:
            while not self.items:
                self.arrived.wait(POLL_S)  # a timed wait: signals are handled meanwhile
            kind, payload = self.items.popleft()
        if kind == "error":
            raise payload
        return kind, payload

    def take_waves_at_head(self) -> list:
        """The waves at the head of the queue, in order, passing over staged syncs (partial rollouts
        take those out of turn), up to the first request of another kind; none if there are none."""
        waves = []
        with self.arrived:
            i = 0
            while i < len(self.items) and self.items[i][0] in ("wave", *self.SYNCS):
                if self.items[i][0] == "wave":
                    waves.append(self.items[i][1])
                    del self.items[i]
                else:
                    i += 1
        return waves

    def wait_for_sync(self) -> None:
        """Until a staged sync (or an error) is in the queue."""
        with self.arrived:
            while not any(item[0] in (*self.SYNCS, "error") for item in self.items):
                self.arrived.wait(POLL_S)

    def take_sync(self):
        """The first staged sync (kind, payload) wherever it is in the queue, None without one; an
        error that arrived is raised."""
        with self.arrived:
            for i, item in enumerate(self.items):
                if item[0] == "error":
                    raise item[1]
                if item[0] in self.SYNCS:
                    del self.items[i]  # by place: == on a payload of tensors has no single truth value
                    return item
        return None

    def loaded(self) -> None:
        """The staged weights are in the engine: the slot is free for the next sync."""
        self.slot.release()


class Outbox:
    """The main thread's replies, sent in order by a thread of their own (module docstring)."""

    def __init__(self, replies):
        self.replies = replies
        self.items: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="rollout-outbox", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            item = self.items.get()
            if item is _CLOSE:
                return
            try:
                self.replies.gather_objects(item)
            except BaseException as e:  # noqa: BLE001 - the main thread raises it at its next put
                self.error = _gone_or(e)
                return

    def put(self, reply) -> None:
        if self.error is not None:
            raise self.error
        self.items.put(reply)

    def close(self) -> None:
        """Send what is queued, then end the thread (the trainer read every reply before its stop)."""
        self.items.put(_CLOSE)
        self.thread.join()
        if self.error is not None:
            raise self.error


_CLOSE = object()
