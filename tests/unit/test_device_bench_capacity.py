"""tools/device_bench.py halves the micro-batch capacity when the GPU runs out of memory (the
1.7B shape at 16384 tokens did on the first H100 run), and gives up below --max-len."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import device_bench  # noqa: E402


def _fake_bench(fits_at: int, tried: list):
    def bench_model(name, cfg, seqs, args, peak, capacity):
        tried.append(capacity)
        if capacity > fits_at:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return {"model": name, "capacity": capacity}

    return bench_model


def test_capacity_is_halved_until_the_step_fits(monkeypatch):
    tried = []
    monkeypatch.setattr(device_bench, "bench_model", _fake_bench(8192, tried))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    args = SimpleNamespace(capacity=16384, max_len=4096)
    out = device_bench.bench_within_memory("1.7B", None, [], args, 1.0)
    assert tried == [16384, 8192]
    assert out["capacity"] == 8192 and out["out_of_memory_at"] == [16384]


def test_out_of_memory_below_the_longest_sequence_is_raised(monkeypatch):
    tried = []
    monkeypatch.setattr(device_bench, "bench_model", _fake_bench(1024, tried))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    args = SimpleNamespace(capacity=16384, max_len=4096)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        device_bench.bench_within_memory("1.7B", None, [], args, 1.0)
    assert tried == [16384, 8192, 4096]
