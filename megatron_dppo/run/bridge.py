"""Dedicated rollout ranks (parallel.rollout_ranks = R > 0): the torchrun world split in two, and
the bridge between the halves.

The first N - R ranks train and the last R run vLLM engines. Each half gets a torch.distributed
world of its own (the default group of its processes), so everything written for one world runs
unchanged in each: Megatron-Core's groups and checkpoints over the training ranks, vLLM's
external launcher over the rollout ranks. Collectives over a world that also held the other
half would need every rank of both in every call (a checkpoint's metadata gathers, vLLM's
groups), and torch offers no second default group, so the halves meet only through the bridge:
process groups made directly on the launcher's store, of training rank 0 and the R rollout ranks
(bridge rank 0 is training rank 0, bridge rank 1 + i is rollout rank i):

  * `control` (gloo): requests from training rank 0 (and the rollout ranks' start-up reports);
  * `replies` (gloo): each rollout rank's reply to a request, in the order of the requests. A group
    of its own because a rollout rank receives requests on one thread and sends replies from
    another (train/rollout_rank.py): a group's calls must come in the same order on every member;
  * `weights` (NCCL on GPUs, gloo on CPU): the policy's HF-named buckets after each optimizer step,
    ended by a marker that counts what was sent (the receiver checks the count).

Both groups run under parallel.timeout_minutes, as every other group does (megatron/parallel.py).

Messages are pickled Python objects between this job's own processes (torch's object collectives
do the same); no checkpoint or file is ever unpickled.
"""

from __future__ import annotations

import math
import os
import pickle
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

_TAG_LENGTH, _TAG_PAYLOAD = 1, 2
_PEER_GONE = ("Connection closed by peer", "Connection reset")  # gloo's words for a member whose process ended
_ALIGN = 16  # bytes: every dtype's alignment, so that a received tensor is a view of its bucket's buffer
_END = "end"  # the weight stream's last header: (_END, buckets, tensors); a bucket's header is a list


@dataclass
class Roles:
    """This process's half of the world: `train` (Megatron) or `rollout` (vLLM), its index in
    that half, and the bridges it is a member of (training rank 0 and every rollout rank; None
    elsewhere)."""

    role: str  # "train" | "rollout"
    rank: int  # in the launcher's world
    world: int
    rollout_ranks: int
    control: Bridge | None = None
    weights: Bridge | None = None
    replies: Bridge | None = None

    @property
    def train_ranks(self) -> int:
        return self.world - self.rollout_ranks

    @property
    def is_rollout(self) -> bool:
        return self.role == "rollout"

    @property
    def local_rank(self) -> int:
        """The rank in this half's world."""
        return self.rank - self.train_ranks if self.is_rollout else self.rank


def split_world(rollout_ranks: int, timeout: timedelta) -> Roles:
    """Under torchrun with rollout_ranks = R > 0: the default group becomes this rank's half (the
    first N - R ranks train, the last R roll out) and the bridges are made. -> this rank's Roles.

    On a rollout rank RANK and WORLD_SIZE are rewritten to its half's (vLLM's external launcher
    reads them to find its rank in the world it is given); LOCAL_RANK, the device, is kept."""
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    if not 0 < rollout_ranks < world:
        raise ValueError(
            f"parallel.rollout_ranks={rollout_ranks} must leave at least one training rank and be > 0 "
            f"in a world of {world} process(es)"
        )
    train = world - rollout_ranks
    role = "rollout" if rank >= train else "train"
    roles = Roles(role, rank, world, rollout_ranks)
    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(
        "nccl" if gpu else "gloo",
        store=dist.PrefixStore(f"dppo/{role}/", store),
        rank=roles.local_rank,
        world_size=rollout_ranks if roles.is_rollout else train,
        timeout=timeout,
    )
    if roles.is_rollout:
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(roles.local_rank), str(rollout_ranks)
    if rank == 0 or roles.is_rollout:
        bridge_rank = 0 if rank == 0 else 1 + roles.local_rank
        size = 1 + rollout_ranks
        roles.control = Bridge(dist.PrefixStore("dppo/bridge/control/", store), bridge_rank, size, timeout)
        roles.replies = Bridge(dist.PrefixStore("dppo/bridge/replies/", store), bridge_rank, size, timeout)
        weights_store = dist.PrefixStore("dppo/bridge/weights/", store)
        roles.weights = Bridge(weights_store, bridge_rank, size, timeout, backend="nccl" if gpu else "gloo")
    return roles


class BridgeBroken(RuntimeError):
    """A member of the bridge went away in the middle of a call (its process ended: killed, or it failed)."""


class WeightStreamError(RuntimeError):
    """A weight sync whose buckets do not add up to what training rank 0 says it sent."""


@dataclass
class StreamCount:
    """What a receiver read of one weight sync (receive_buckets): buckets, tensors, and whether it
    read through to the end marker."""

    buckets: int = 0
    tensors: int = 0
    ended: bool = False
    last: str = ""  # the last tensor's name, to say where a stream stopped

    def add(self, header: list) -> None:
        """One more bucket, by its header [(name, dtype, shape), ...]."""
        self.buckets, self.tensors, self.last = self.buckets + 1, self.tensors + len(header), header[-1][0]


class Bridge:
    """A process group of training rank 0 (bridge rank 0) and the rollout ranks, outside both
    halves' worlds (split_world). Collective calls: every member calls them in the same order."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta, backend: str = "gloo"):
        self.rank, self.size, self.backend = rank, size, backend
        self.store = store  # the members' own messages outside the group (a stop nobody waits for)
        if backend == "nccl":
            # the CUDA ordinal as an int, which every device= and .to() take: a torch.device("cuda", i)
            # built here breaks under cpu_compat's CUDA-to-CPU mode, as a test in a Megatron process meets it
            self.device = torch.cuda.current_device()
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout  # torch's own new_group sets it so; the default is 10 minutes
            self.group = dist.ProcessGroupNCCL(store, rank, size, options)
        else:
            self.device = torch.device("cpu")
            self.group = dist.ProcessGroupGloo(store, rank, size, timeout)

    def _wait(self, op, *args) -> None:
        """One group operation, op(*args), to its end; a member gone (gloo's words) as BridgeBroken."""
        try:
            op(*args).wait()
        except RuntimeError as e:
            if any(words in str(e) for words in _PEER_GONE):
                raise BridgeBroken(
                    "a member of the bridge between training rank 0 and the rollout ranks went away (its process "
                    "ended: killed, or it failed; see its output)"
                ) from e
            raise

    def _broadcast(self, tensor: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self._wait(self.group.broadcast, [tensor], opts)
        if self.backend == "nccl":  # wait() orders the stream only: the buffer is let go or read right after
            torch.cuda.current_stream().synchronize()

    def broadcast_object(self, obj=None):
        """Bridge rank 0's obj on every member."""
        length = torch.zeros(1, dtype=torch.int64, device=self.device)
        payload = b""
        if self.rank == 0:
            payload = pickle.dumps(obj)
            length[0] = len(payload)
        self._broadcast(length)
        data = (
            torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
            if self.rank == 0
            else torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
        )
        self._broadcast(data)
        return obj if self.rank == 0 else pickle.loads(data.cpu().numpy().tobytes())

    def gather_objects(self, obj=None) -> list | None:
        """On bridge rank 0: [the obj of bridge rank 1, ..., of rank size-1]; None on the others,
        which send theirs (rank 0's own obj is not sent)."""
        if self.rank != 0:
            payload = pickle.dumps(obj)
            length = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
            self._wait(self.group.send, [length], 0, _TAG_LENGTH)
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
            self._wait(self.group.send, [data], 0, _TAG_PAYLOAD)
            return None
        out = []
        for src in range(1, self.size):
            length = torch.zeros(1, dtype=torch.int64, device=self.device)
            self._wait(self.group.recv, [length], src, _TAG_LENGTH)
            data = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
            self._wait(self.group.recv, [data], src, _TAG_PAYLOAD)
            out.append(pickle.loads(data.cpu().numpy().tobytes()))
        return out

    def send_buckets(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], stats: dict | None = None) -> None:
        """Bridge rank 0: each bucket of (HF name, tensor) as one flat byte buffer after its names,
        dtypes and shapes; the end as (_END, buckets sent, tensors sent). An empty bucket is not
        sent (it has no bytes to send, and the receivers check the count). What is held at once:
        a bucket and its flat copy (on NCCL, the copy is on the device)."""
        stats = stats if stats is not None else {}
        stats.setdefault("num_tensors", 0)
        stats.setdefault("num_bytes", 0)
        sent = StreamCount()
        for bucket in buckets:
            if not bucket:
                continue
            header = [(name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in bucket]
            parts = []
            for _, t in bucket:  # each tensor's bytes padded to _ALIGN: the receiver views them in place
                raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
                parts += [raw, raw.new_zeros(-raw.numel() % _ALIGN)]
            flat = torch.cat(parts)
            del parts
            del bucket
            self.broadcast_object(header)
            self._broadcast(flat.to(self.device))
            stats["num_tensors"] += len(header)
            stats["num_bytes"] += sum(_nbytes(dtype, shape) for _, dtype, shape in header)
            sent.add(header)
            del flat
        self.broadcast_object((_END, sent.buckets, sent.tensors))

    def receive_buckets(self, count: StreamCount | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The other members: the buckets bridge rank 0 sends (send_buckets), one at a time, as
        views of one received buffer per bucket (on this member's device). `count` (the caller's)
        says how far the stream was read: ended once the end marker came and its counts matched
        (WeightStreamError otherwise)."""
        count = count if count is not None else StreamCount()
        while True:
            header = self.broadcast_object()
            if isinstance(header, tuple) and header[:1] == (_END,):
                _check_end(header, count)
                count.ended = True
                return
            if not isinstance(header, list) or not header:
                raise WeightStreamError(
                    f"weights bridge: expected a bucket's header (a non-empty list) or the end marker after "
                    f"{count.buckets} bucket(s), got {header!r:.200}"
                )
            sizes = [_nbytes(dtype, shape) for _, dtype, shape in header]
            flat = torch.empty(sum(s + -s % _ALIGN for s in sizes), dtype=torch.uint8, device=self.device)
            self._broadcast(flat)
            bucket, offset = [], 0
            for (name, dtype, shape), size in zip(header, sizes):
                bucket.append((name, flat[offset : offset + size].view(getattr(torch, dtype)).view(shape)))
                offset += size + -size % _ALIGN
            del flat
            count.add(header)
            yield bucket


def _check_end(marker: tuple, count: StreamCount) -> None:
    """The end marker's counts against what was received: a stream that lost or gained a bucket is
    named, and the rank ends rather than sample with what it loaded."""
    _, buckets, tensors = marker
    if (buckets, tensors) != (count.buckets, count.tensors):
        raise WeightStreamError(
            f"weights bridge: training rank 0 sent {buckets} bucket(s) of {tensors} tensor(s), this rank received "
            f"{count.buckets} of {count.tensors}"
        )


def _nbytes(dtype: str, shape) -> int:
    """A tensor's bytes from send_buckets' header entry (dtype name, shape)."""
    return math.prod(shape) * getattr(torch, dtype).itemsize
