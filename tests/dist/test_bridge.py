"""Dedicated rollout ranks' plumbing (megatron_dppo/run/bridge.py): the world split in two halves
and the bridge of training rank 0 and the rollout ranks, in 4 processes (2 + 2)."""

from pathlib import Path

WORKER = Path(__file__).resolve().parent / "workers" / "rollout" / "bridge_worker.py"


def test_split_world_gives_each_half_its_world_and_the_bridge_carries_objects_and_buckets(torchrun):
    out = torchrun(WORKER, 4)
    for rank in range(4):
        assert f"[rank {rank}] bridge ok" in out
