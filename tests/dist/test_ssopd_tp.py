"""SSOPD's divergences vocab-parallel over a real 2-process gloo group equal the full-vocabulary
definition, values and gradients (the worker: tests/dist/workers/methods/ssopd_tp.py; the
single-process rules: tests/unit/test_ssopd.py)."""

from pathlib import Path


def test_divergences_are_the_same_sharded_over_two_tp_ranks(torchrun):
    out = torchrun(Path(__file__).resolve().parent / "workers" / "methods" / "ssopd_tp.py", 2, timeout=120)
    assert out.count("ssopd tp ok") == 2, out
