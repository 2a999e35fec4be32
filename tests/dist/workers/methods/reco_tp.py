"""torchrun --nproc_per_node 2 tests/dist/workers/methods/reco_tp.py (tests/dist/test_reco_tp.py runs it):
ReCo's Gini impurity vocab-parallel over the 2 ranks' columns of the padded head equal the full-vocabulary
reference of tests/unit/test_reco.py (imported from there: one copy of the reference)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "unit"))
from test_reco import PADDED, VOCAB, _gini_reference, _logits  # noqa: E402

from megatron_dppo.algorithms.methods.reco import rules as reco  # noqa: E402


def _tp_worker():
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    part = PADDED // world
    for temperature, chunk in [(1.0, 1024), (0.6, 4)]:
        logits = _logits(7)
        got = reco.gini_impurity(
            logits[:, rank * part : (rank + 1) * part],
            vocab_size=VOCAB,
            temperature=temperature,
            group=dist.group.WORLD,
            chunk_size=chunk,
        )
        err = float((got.double() - _gini_reference(logits, temperature)).abs().max())
        assert err < 2e-6, f"rank {rank}: TP gini differs by {err}"
    print(f"[rank {rank}] gini tp ok", flush=True)
    dist.barrier()  # every rank past its last collective before gloo is torn down (a teardown abort seen in CI)
    dist.destroy_process_group()


if __name__ == "__main__":
    _tp_worker()
