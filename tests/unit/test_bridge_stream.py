"""The weights bridge's stream (megatron_dppo/run/bridge.py) through a loopback in one process:
an empty bucket is skipped, not taken for the end; the end marker counts what was sent and the
receiver checks it; the rollout rank checks that its engine read each sync to the end marker
(train/rollout_mail.receive_weights, then load_staged_weights); the bridge's groups run under
parallel.timeout_minutes.
The real groups, in 4 processes: tests/dist/test_bridge.py."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from megatron_dppo.run.bridge import Bridge, StreamCount, WeightStreamError
from megatron_dppo.train.rollout_mail import load_staged_weights, receive_weights


class Loopback(Bridge):
    """One member of a two-member bridge whose broadcasts go through `wire`, a list: bridge rank 0
    appends what it sends, rank 1 reads it back in order (rank 0 sends all before rank 1 reads)."""

    def __init__(self, rank: int, wire: list):
        self.rank, self.size, self.backend, self.device, self.wire = rank, 2, "gloo", torch.device("cpu"), wire

    def _broadcast(self, tensor: torch.Tensor) -> None:
        if self.rank == 0:
            self.wire.append(tensor.clone())
        else:
            tensor.copy_(self.wire.pop(0))


def _sent(buckets) -> list:
    """The wire after bridge rank 0 sent `buckets` (the stats it counted checked on the way)."""
    wire, stats = [], {}
    Loopback(0, wire).send_buckets(iter(buckets), stats)
    assert stats["num_tensors"] == sum(len(b) for b in buckets)
    return wire


def _names(buckets) -> list:
    return [[name for name, _ in b] for b in buckets]


BUCKETS = [
    [("a", torch.arange(3.0))],
    [("b", torch.ones(2, 2, dtype=torch.bfloat16)), ("c", torch.arange(5, dtype=torch.int32))],
]


def test_an_empty_bucket_is_skipped_not_taken_for_the_end():
    """Before: the sender failed on it (torch.cat of nothing), and its header, an empty list, was
    the end marker: a receiver would have stopped there."""
    buckets = [[], BUCKETS[0], [], BUCKETS[1], []]
    count = StreamCount()
    got = list(Loopback(1, _sent(buckets)).receive_buckets(count))
    assert _names(got) == _names(BUCKETS)
    assert all(torch.equal(g, s) for bg, bs in zip(got, BUCKETS) for (_, g), (_, s) in zip(bg, bs))
    assert (count.buckets, count.tensors, count.ended, count.last) == (2, 3, True, "c")


def test_a_stream_that_lost_a_bucket_is_named_at_its_end_marker():
    wire = _sent(BUCKETS)
    del wire[:3]  # the first bucket's header (its length, its bytes) and its buffer
    receiver = Loopback(1, wire).receive_buckets()
    assert _names([next(receiver)]) == _names(BUCKETS[1:])
    with pytest.raises(WeightStreamError) as e:
        next(receiver)
    assert str(e.value) == (
        "weights bridge: training rank 0 sent 2 bucket(s) of 3 tensor(s), this rank received 1 of 2"
    )


class Engine:
    """RolloutEngine's load_weights as the rollout rank calls it: reads `reads` buckets of the
    stream (None: all of them)."""

    def __init__(self, reads=None):
        self.reads, self.loaded = reads, []

    def load_weights(self, weights):
        weights = iter(weights)
        for bucket in weights if self.reads is None else (next(weights) for _ in range(self.reads)):
            self.loaded += [name for name, _ in bucket]


def test_the_rollout_rank_loads_a_sync_read_to_its_end_marker():
    engine = Engine()
    count = load_staged_weights(engine, receive_weights(Loopback(1, _sent(BUCKETS))), 3)
    assert engine.loaded == ["a", "b", "c"] and (count.buckets, count.tensors, count.ended) == (2, 3, True)


@pytest.mark.parametrize("reads", [0, 1])
def test_an_engine_that_stopped_reading_before_the_end_marker_is_named(reads):
    """Before: the rollout rank went on with the rest of the sync left in the bridge, and its
    weights two versions mixed."""
    with pytest.raises(WeightStreamError) as e:
        load_staged_weights(Engine(reads), receive_weights(Loopback(1, _sent(BUCKETS))), 3)
    after = "before its first bucket" if reads == 0 else "after 1 bucket(s), 1 tensor(s), the last 'a'"
    assert str(e.value) == (
        f"rollout rank: the engine's load of step 3's weights returned {after}, before the weights bridge's "
        "end marker: its weights mix two versions"
    )


class FakeNCCL:
    """dist.ProcessGroupNCCL where this torch has none (a CPU build): records its options."""

    class Options:
        def __init__(self):
            self._timeout = timedelta(minutes=10)  # NCCL's default

    def __init__(self, store, rank, size, options):
        self.options = options


def test_both_backends_of_the_bridge_run_under_parallel_timeout_minutes(monkeypatch):
    """Before: the weights bridge's NCCL group kept NCCL's default (10 minutes); gloo's had it."""
    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for backend in ("gloo", "nccl"):
        bridge = Bridge(dist.HashStore(), 0, 1, timedelta(minutes=7), backend=backend)
        assert bridge.group.options._timeout == timedelta(minutes=7), backend


def test_the_nccl_bridge_builds_under_the_cpu_compat_mode(monkeypatch):
    """A pytest process that ran Megatron code keeps cpu_compat's CUDA-to-CPU mode on: the bridge's
    CUDA device must not be a torch.device("cuda", i) built there (the mode turns "cuda" into a
    device object that torch.device refuses: a make test run failed on that order of tests)."""
    from megatron_dppo.megatron.cpu_compat import _CudaToCpu

    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with _CudaToCpu():
        bridge = Bridge(dist.HashStore(), 0, 1, timedelta(minutes=7), backend="nccl")
    assert bridge.device == 0 and bridge.group.options._timeout == timedelta(minutes=7)
