"""torchrun --nproc_per_node 4 tests/dist/workers/rollout/bridge_worker.py (tests/dist/test_bridge.py runs
it): run/bridge.split_world with 2 rollout ranks gives each half a world of its own and the bridge
between training rank 0 and the rollout ranks. Checked against what each rank knows independently
(its launcher rank): the halves' worlds, objects both ways, weight buckets bit for bit (an empty
bucket among them skipped, each receiver read to the end marker), both bridges' timeout."""

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_dppo.run.bridge import StreamCount, split_world


def _buckets(seed: int):
    """Three buckets of tensors of several dtypes and odd sizes (offsets not aligned to their dtype),
    and an empty one (an empty header was the stream's end)."""
    gen = torch.Generator().manual_seed(seed)
    return [
        [("a", torch.randn(3, generator=gen)), ("b", torch.randn(5, 7, generator=gen).to(torch.bfloat16))],
        [],
        [
            ("c", torch.randint(0, 100, (11,), generator=gen, dtype=torch.int32)),
            ("d", torch.randn(2, 2, generator=gen)),
        ],
        [("e", torch.randn(1, generator=gen, dtype=torch.float64))],
    ]


def main():
    launcher_rank, launcher_world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    roles = split_world(2, timedelta(seconds=60))
    train = launcher_world - 2
    assert roles.is_rollout == (launcher_rank >= train), roles
    assert dist.get_world_size() == (2 if roles.is_rollout else train)
    assert dist.get_rank() == (launcher_rank - train if roles.is_rollout else launcher_rank)
    if roles.is_rollout:  # what vLLM's external launcher reads: the rollout half's own ranks
        assert os.environ["RANK"] == str(launcher_rank - train) and os.environ["WORLD_SIZE"] == "2"
    # each half's collectives stay in that half
    total = torch.tensor([float(launcher_rank)])
    dist.all_reduce(total)
    expect = sum(range(train, launcher_world)) if roles.is_rollout else sum(range(train))
    assert total.item() == expect, (launcher_rank, total.item(), expect)
    on_bridge = launcher_rank == 0 or roles.is_rollout
    assert (roles.control is not None) == on_bridge == (roles.weights is not None)
    if on_bridge:
        assert roles.control.group.options._timeout == roles.weights.group.options._timeout == timedelta(seconds=60)
        sent = {"kind": "wave", "ids": list(range(5))}
        assert roles.control.broadcast_object(sent if launcher_rank == 0 else None) == sent
        replies = roles.control.gather_objects(("reply", launcher_rank, "x" * launcher_rank * 1000))
        if launcher_rank == 0:
            assert replies == [("reply", r, "x" * r * 1000) for r in range(train, launcher_world)], replies
        else:
            assert replies is None
        sent = _buckets(7)
        if launcher_rank == 0:
            stats = {}
            roles.weights.send_buckets(iter(sent), stats)
            assert stats["num_tensors"] == 5
        else:
            count = StreamCount()
            got = list(roles.weights.receive_buckets(count))
            sent = [b for b in sent if b]
            assert [[n for n, _ in b] for b in got] == [[n for n, _ in b] for b in sent]
            assert (count.buckets, count.tensors, count.ended) == (3, 5, True), count
            for bg, bs in zip(got, sent):
                for (_, tg), (_, ts) in zip(bg, bs):
                    assert tg.dtype == ts.dtype and tg.shape == ts.shape and torch.equal(tg, ts)
    dist.barrier()
    print(f"[rank {launcher_rank}] bridge ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
