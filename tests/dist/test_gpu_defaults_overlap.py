"""The GPU settings' overlapped gradient reduce, in 2 torchrun workers: the same gradients as without it."""

from pathlib import Path

HERE = Path(__file__).resolve().parent


def test_overlapped_grad_reduce_gives_the_same_gradients_dp2(launch):
    res = launch(HERE.parent / "dist" / "workers" / "model" / "overlap_worker.py", 2)
    assert res.returncode == 0 and "OVERLAP GRAD REDUCE OK" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]
