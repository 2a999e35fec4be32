"""ReCo's token scale (the Gini impurity) vocab-parallel over a real 2-process gloo group equals the
full-vocabulary formula (the worker: tests/dist/workers/methods/reco_tp.py; the single-process rules:
tests/unit/test_reco.py)."""

from pathlib import Path


def test_gini_is_the_same_sharded_over_two_tp_ranks(torchrun):
    out = torchrun(Path(__file__).resolve().parent / "workers" / "methods" / "reco_tp.py", 2, timeout=120)
    assert out.count("gini tp ok") == 2, out
