"""torchrun --nproc_per_node 2 tests/dist/workers/methods/ssopd_tp.py (tests/dist/test_ssopd_tp.py runs it):
SSOPD's divergences vocab-parallel over the 2 ranks' columns of the padded head equal the full-vocabulary
reference of tests/unit/test_ssopd.py (imported from there: one copy of the reference)."""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "unit"))
from test_ssopd import CASES, PADDED, VOCAB, _compare, _logits  # noqa: E402


def _tp_worker():
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cols = slice(rank * PADDED // world, (rank + 1) * PADDED // world)
    zt, zs_full = _logits(11), _logits(12)
    targets = torch.randint(VOCAB, (zt.shape[0],), generator=torch.Generator().manual_seed(13))
    for kind, topk, temperature in CASES:
        err, grad_err = _compare(
            kind, topk, temperature, zt, zs_full, targets, cols=cols, group=dist.group.WORLD, chunk_size=5
        )
        assert err < 1e-10 and grad_err < 1e-10, f"rank {rank} {kind} topk={topk}: value {err}, grad {grad_err}"
    print(f"[rank {rank}] ssopd tp ok", flush=True)
    dist.barrier()  # every rank past its last collective before gloo is torn down (a teardown abort seen in CI)
    dist.destroy_process_group()


if __name__ == "__main__":
    _tp_worker()
