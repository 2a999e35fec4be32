#!/usr/bin/env python
"""Train-step tokens/s and MFU of Qwen3-0.6B- and 1.7B-shaped models on ONE GPU, packed vs padded.

Prepared for a lent GPU (docs/profiling.md, "Device benchmark"); nothing here has run on one yet.

    # on the GPU machine, from the repository root (bf16, random weights: only shapes matter)
    python tools/device_bench.py                        # 0.6B and 1.7B, packed and padded
    python tools/device_bench.py --sizes 0.6B --steps 3 # shorter
    # here, on CPU, as a test of the script itself
    .venv/bin/python tools/device_bench.py --tiny

What it measures. One optimizer step = MegatronPolicy.train_step (the trainer's own forward /
backward with the DPPO loss, Megatron DDP and optimizer) over a fixed batch of RL-shaped
sequences (prompt 64-512 tokens, long-tailed completions, <= --max-len), built two ways from the
SAME sequences: packed THD micro-batches (packing.pack, window = all) and the padded baseline
(packing.pack_padded: rows padded to the longest, rows x longest <= capacity). The attention is
the project's local path (build_gpt_model(attention="local"): per-sequence torch SDPA), because
the GPU image has no Transformer Engine. tokens/s counts real tokens only; MFU = model FLOPs of
the real tokens (megatron_dppo.profiling.train_flops) / step time / device peak (H100/H200 bf16
dense 989 TFLOP/s; unknown GPU or CPU: measured with a matmul). Padding is wasted work, so it
lowers the padded layout's tokens/s and MFU: that difference is the point of the comparison.

What the GPU image lacks, and what to carry. It has torch 2.11 but no megatron-core, vLLM,
Transformer Engine or transformers. Besides torch and numpy this script needs megatron-core 0.16.1
and three small packages an image may lack: packaging (megatron-core's dependency), setuptools
(torch.utils.cpp_extension, which megatron-core imports, imports it) and PyYAML
(megatron_dppo.config). megatron_dppo comes with the working tree; transformers is not needed
(config.json is read as plain JSON). All four are pure python for this use (megatron-core's
compiled dataset helpers are not imported), so either
  * carry their source trees from this checkout's venv (~31 MB; checked on CPU with only torch
    and numpy on the path):
      run(carry=[".venv/lib/python3.11/site-packages/megatron", ".venv/lib/python3.11/site-packages/yaml",
                 ".venv/lib/python3.11/site-packages/packaging", ".venv/lib/python3.11/site-packages/setuptools",
                 ".venv/lib/python3.11/site-packages/_distutils_hack"], ...)
    when one of them does not import, this script appends that site-packages folder to sys.path
    (after the image's own packages) and stops at once, naming it, if something is still missing; or
  * carry the wheel: `pip download megatron-core==0.16.1 --no-deps -d wheels` here (pick the
    device's --python-version / --platform if they differ), then on the device
    `pip install --no-deps wheels/megatron_core-0.16.1-*.whl` before running this script.
numpy cannot be carried that way (compiled for one python version): the image must have it.
Writes JSON to --out (default $OUT/device_bench.json when $OUT is set, else runs/device_bench.json).
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
# What megatron_dppo.megatron needs beyond torch; setuptools because torch.utils.cpp_extension (imported
# by megatron.core) imports it, yaml because megatron_dppo.config does.
NEEDED = ("torch", "numpy", "packaging", "setuptools", "yaml", "megatron")
CARRIED = REPO / ".venv" / "lib" / "python3.11" / "site-packages"


def _missing() -> list[str]:
    import importlib.util
    return [m for m in NEEDED if importlib.util.find_spec(m) is None]


if _missing():  # fall back to the carried pure-python packages, after the image's own
    sys.path.append(str(CARRIED))
    if _missing():
        sys.exit(f"device_bench: cannot import {_missing()}; carry them (see the docstring): "
                 + ", ".join(f".venv/lib/python3.11/site-packages/{m}" for m in _missing()))

import torch  # noqa: E402

from megatron_dppo import packing, profiling

CONFIGS = REPO / "examples" / "qwen3_configs"
TINY = REPO / "examples" / "tiny" / "model" / "config.json"


def hf_config(path: Path) -> SimpleNamespace:
    """config.json as attributes (what build_gpt_model reads), without transformers."""
    return SimpleNamespace(**json.loads(Path(path).read_text()))


def rl_lengths(n: int, max_len: int, seed: int = 0) -> list[tuple[int, int]]:
    """(prompt_len, total_len) of n RL-like sequences: prompts 64-512 (scaled down with max_len),
    completions log-normal around max_len/6 with a long tail, capped at max_len."""
    rng = random.Random(seed)
    lo, hi = max(max_len // 64, 1), max(max_len // 8, 2)
    out = []
    for _ in range(n):
        p = rng.randint(lo, hi)
        c = int(math.exp(rng.gauss(math.log(max_len / 6), 0.8)))
        out.append((p, min(p + max(c, 1), max_len)))
    return out


def samples(lengths, vocab: int, seed: int = 0) -> list[packing.Sample]:
    g = torch.Generator().manual_seed(seed)
    return [packing.Sample(tokens=torch.randint(0, vocab, (total,), generator=g).tolist(), prompt_len=p,
                           advantage=1.0 if k % 2 else -1.0, seq_id=k)
            for k, (p, total) in enumerate(lengths)]


def microbatches(seqs, layout: str, capacity: int):
    lengths = [len(s.tokens) for s in seqs]
    if layout == "packed":
        packs = packing.pack(lengths, capacity, window=len(lengths))
        build = packing.build_thd_batch
    else:
        packs = packing.pack_padded(lengths, capacity)
        build = packing.build_padded_batch
    return [build([seqs[i] for i in p]) for p in packs], packing.density(lengths, packs, capacity)


def bench_model(name: str, cfg, seqs, args, peak: float) -> dict:
    from megatron_dppo.megatron.step import LossConfig, MegatronPolicy, OptimConfig

    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    t0 = time.perf_counter()
    # One GPU = one data-parallel rank: the distributed optimizer would shard nothing, so leave it off.
    policy = MegatronPolicy(cfg, OptimConfig(lr=1e-6), LossConfig(), params_dtype=dtype, attention="local",
                            distributed_optimizer=False)
    out = {"model": name, "dtype": str(dtype).replace("torch.", ""), "build_s": time.perf_counter() - t0,
           "matmul_params": profiling.matmul_params(vars(cfg))}
    real = [len(s.tokens) for s in seqs]
    flops = profiling.train_flops(vars(cfg), real)
    denominator = float(sum(len(s.tokens) - s.prompt_len for s in seqs))  # token-mean over the batch
    for layout in ("packed", "padded"):
        mbs, density = microbatches(seqs, layout, args.capacity)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        times = []
        for k in range(args.warmup + args.steps):
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            policy.train_step(mbs, denominator)  # returns python floats: the step has finished
            if cuda:
                torch.cuda.synchronize()
            if k >= args.warmup:
                times.append(time.perf_counter() - t)
        step_s = statistics.median(times)  # robust to a stray slow step
        out[layout] = {
            "micro_batches": len(mbs), "density": density, "step_s": step_s, "step_s_all": times,
            "tokens_per_s": sum(real) / step_s, "mfu": profiling.mfu(flops, step_s, peak),
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        }
        print(f"{name} {layout}: {len(mbs)} micro-batches, density {density:.3f}, {step_s:.3f}s/step, "
              f"{sum(real) / step_s:,.0f} tokens/s, MFU {100 * out[layout]['mfu']:.1f}%", flush=True)
    out["packed_speedup"] = out["padded"]["step_s"] / out["packed"]["step_s"]
    del policy
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="0.6B,1.7B", help="comma-separated dirs of examples/qwen3_configs")
    p.add_argument("--tiny", action="store_true", help="the tiny CPU model, a few short sequences (a test)")
    p.add_argument("--seqs", type=int, default=64, help="sequences per optimizer step (e.g. 8 prompts x G=8)")
    p.add_argument("--max-len", type=int, default=4096, help="longest sequence (prompt + completion)")
    p.add_argument("--capacity", type=int, default=16384, help="max tokens per micro-batch")
    p.add_argument("--steps", type=int, default=5, help="timed optimizer steps per layout")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--peak-tflops", type=float, default=0.0, help="override the device peak")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    if args.tiny:
        args.seqs, args.max_len, args.capacity = min(args.seqs, 16), min(args.max_len, 24), min(args.capacity, 64)
        args.steps, args.warmup = min(args.steps, 2), min(args.warmup, 1)
        models = {"tiny": TINY}
    else:
        models = {s: CONFIGS / s / "config.json" for s in args.sizes.split(",")}
    out_path = Path(args.out or (Path(os.environ["OUT"]) / "device_bench.json" if os.environ.get("OUT")
                                 else REPO / "runs" / "device_bench.json"))

    from megatron_dppo.megatron import destroy_parallel, initialize_parallel
    initialize_parallel(1, 1, seed=0)
    kind = profiling.detect_device()
    peak, source = profiling.device_peak_flops(kind, args.peak_tflops * 1e12 if args.peak_tflops else None)
    result = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__, "peak_flops": peak, "peak_source": source,
              "seqs": args.seqs, "max_len": args.max_len, "capacity": args.capacity, "steps": args.steps,
              "attention": "local (per-sequence torch SDPA; no Transformer Engine)", "models": []}
    print(f"{result['device']}: peak {peak / 1e12:.2f} TFLOP/s ({source})", flush=True)
    try:
        for name, path in models.items():
            cfg = hf_config(path)
            seqs = samples(rl_lengths(args.seqs, args.max_len), cfg.vocab_size)
            result["real_tokens"] = sum(len(s.tokens) for s in seqs)
            result["models"].append(bench_model(name, cfg, seqs, args, peak))
            out_path.parent.mkdir(parents=True, exist_ok=True)
            out_path.write_text(json.dumps(result, indent=1))  # after each model: a timeout keeps the rest
    finally:
        destroy_parallel()
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
