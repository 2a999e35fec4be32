#!/usr/bin/env python
"""First contact with a GPU, on ONE GPU: correctness checks (the Transformer Engine and vLLM parts
where those import, else skipped with the reason recorded), then train-step tokens/s and MFU of
Qwen3-0.6B- and 1.7B-shaped models, packed vs padded.

    python tools/device_bench.py            # everything; under 8 minutes on one H100/H200 (--budget-s)
    python tools/device_bench.py --smoke    # the same code paths at toy size: here on the CPU (a test),
                                            # or a one-minute first pass on the GPU
    python tools/device_bench.py --tiny     # only the throughput part, at toy size (what --smoke runs last)

Sections, in this order; each adds its result to the JSON (--out, default $OUT/device_bench.json
or runs/device_bench.json) as it finishes, so a timeout keeps what ran, and a failing section is
recorded and the next one still runs (exit status 1 if any check failed):
  grad-check  tools/device_checks.grad_check in fp32 and in bf16: MegatronPolicy's DPPO gradient
              with the distributed optimizer (on by default with CUDA; hf_grads gathers its
              reduce-scattered shards) against plain PyTorch on the transformers model, then one
              optimizer step. In bf16 the packed micro-batches go through torch's varlen flash
              attention (megatron/attention.py picks it on CUDA for 16-bit tensors).
  te          the same grad check through Transformer Engine's attention (model.attention=te), in
              fp32 and bf16; a dtype TE cannot run (no transformer_engine; fp32 on TE < 2.11) is
              skipped with the policy's own error as the reason.
  moe         the grad check of a tiny Qwen3-MoE (device_checks.TOY_MOE: 4 experts, top-2, EP=1)
              through Transformer Engine where it runs (the GPU settings on: grouped GEMM, permute
              and router fusions, gradient accumulation fusion), else the local path with the
              reason recorded; then, where vllm imports, the vLLM cycle of the tiny MoE
              (tools/make_tiny_moe.py; vLLM's FusedMoE and, on a GPU, Model Runner V2).
  families    the grad check of the Llama (llama3 RoPE) and Qwen2 (q/k/v biases) toys
              (device_checks.TOY_LLAMA, TOY_QWEN2) through Transformer Engine where it runs, else
              the local path with the reason recorded.
  kl          the grad check with parallel.distributed_optimizer=false and a reference model
              (kl_coef 0.1): the reference model's forward on the device and its log-probs
              against transformers', the KL term's gradient, DDP's all-reduce path.
  convert     tools/device_checks.convert_and_verify: tools/convert_hf_to_megatron.py --verify on
              a random-weight Qwen3-0.6B-shaped model (2 layers): Megatron on the GPU vs
              transformers on the CPU, max |logit difference|.
  vllm        tools/device_checks.vllm_cycle, where vllm imports: dummy start, sleep, a train step,
              wake, weight reload, generate, and the sampled tokens' log-probs against Megatron's
              (bf16 on a GPU, fp32 on the CPU).
  bench       MegatronPolicy.train_step (the trainer's forward/backward with the DPPO loss, Megatron
              DDP and distributed optimizer, bf16) over one batch of RL-shaped sequences (prompts
              64-512 tokens, log-normal completions, <= --max-len), built twice from the SAME
              sequences: packed THD micro-batches (packing.pack) and the padded baseline
              (packing.pack_padded). tokens/s counts real tokens; MFU = model FLOPs of the real
              tokens (profiling.train_flops) / median step time / peak (the data sheet's bf16 dense
              peak, and a measured 8192^3 bf16 matmul rate beside it).
What the GPU image lacks and how to bring it (a wheel of megatron-core): docs/profiling.md.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))
# What the sections import besides this repository: megatron-core is the one the GPU image lacks.
NEEDED = ("torch", "numpy", "packaging", "yaml", "einops", "megatron", "transformers", "safetensors")
_missing = [m for m in NEEDED if importlib.util.find_spec(m) is None]
if _missing:
    sys.exit(
        f"device_bench: cannot import {', '.join(_missing)}: install them first (for megatron: the "
        "megatron-core 0.16.1 wheel, docs/profiling.md 'Device benchmark')"
    )

import device_checks  # noqa: E402
import torch  # noqa: E402

from megatron_dppo.algorithms import packing  # noqa: E402
from megatron_dppo.run import profiling

CONFIGS = REPO / "examples" / "qwen3_configs"
TINY = REPO / "examples" / "tiny" / "model" / "config.json"
GRAD_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2}  # bf16: its 8-bit mantissa, not a bug
# max |vLLM - Megatron| per sampled token's log-prob: two implementations, same weights. bf16:
# different kernels and reduction orders in 16-bit (a reload that failed gives nats).
VLLM_LOGP_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.25}
SECTIONS = ("grad-check", "te", "moe", "families", "kl", "convert", "vllm", "bench")
KL_COEF = 0.1
# |reference model - transformers| per completion token's log-prob (the reference forward): fp32
# exact up to summation order; bf16 the policy's 16-bit arithmetic against fp32 on the same weights.
REF_LOGP_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 0.25}


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
    return [
        packing.Sample(
            tokens=torch.randint(0, vocab, (total,), generator=g).tolist(),
            prompt_len=p,
            advantage=1.0 if k % 2 else -1.0,
            seq_id=k,
        )
        for k, (p, total) in enumerate(lengths)
    ]


def microbatches(seqs, layout: str, capacity: int):
    lengths = [len(s.tokens) for s in seqs]
    if layout == "packed":
        packs = packing.pack(lengths, capacity, window=len(lengths))
        build = packing.build_thd_batch
    else:
        packs = packing.pack_padded(lengths, capacity)
        build = packing.build_padded_batch
    return [build([seqs[i] for i in p]) for p in packs], packing.density(lengths, packs, capacity)


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def bench_model(name: str, cfg, seqs, args, peak: float, capacity: int) -> dict:
    from megatron_dppo.config import AlgorithmConfig, OptimConfig
    from megatron_dppo.megatron.model import module_device
    from megatron_dppo.megatron.policy import MegatronPolicy

    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    t0 = time.perf_counter()
    # The trainer's GPU default: the distributed optimizer (one rank here, so it shards nothing,
    # but the reduce-scatter / param all-gather path is the one that runs).
    policy = MegatronPolicy(
        cfg, OptimConfig(lr=1e-6), AlgorithmConfig(), params_dtype=dtype, attention="local", distributed_optimizer=True
    )
    out = {
        "model": name,
        "dtype": str(dtype).replace("torch.", ""),
        "build_s": time.perf_counter() - t0,
        "matmul_params": profiling.matmul_params(vars(cfg)),
        "distributed_optimizer": True,
        "packed_attention": device_checks._thd_impl(module_device(policy.model), dtype, cfg.head_dim),
        "capacity": capacity,
    }
    real = [len(s.tokens) for s in seqs]
    flops = profiling.train_flops(vars(cfg), real)
    denominator = float(sum(len(s.tokens) - s.prompt_len for s in seqs))  # token-mean over the batch
    for layout in ("packed", "padded"):
        mbs, density = microbatches(seqs, layout, capacity)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        times = []
        for k in range(args.warmup + args.steps):
            _sync()
            t = time.perf_counter()
            policy.train_step(mbs, denominator)  # returns python floats: the step has finished
            _sync()
            if k >= args.warmup:
                times.append(time.perf_counter() - t)
        step_s = statistics.median(times)  # robust to a stray slow step
        out[layout] = {
            "micro_batches": len(mbs),
            "density": density,
            "step_s": step_s,
            "step_s_all": times,
            "tokens_per_s": sum(real) / step_s,
            "mfu": profiling.mfu(flops, step_s, peak),
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        }
        print(
            f"{name} {layout}: {len(mbs)} micro-batches, density {density:.3f}, {step_s:.3f}s/step, "
            f"{sum(real) / step_s:,.0f} tokens/s, MFU {100 * out[layout]['mfu']:.1f}%"
            + (f" (attention {out['packed_attention']})" if layout == "packed" else ""),
            flush=True,
        )
    out["packed_speedup"] = out["padded"]["step_s"] / out["packed"]["step_s"]
    out["model_flops_per_step"] = flops
    del policy
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def bench_within_memory(name: str, cfg, seqs, args, peak: float) -> dict:
    """bench_model at --capacity tokens per micro-batch, halved while the GPU runs out of memory
    (not below --max-len): on the first H100 run the 1.7B shape at 16384 did (docs/profiling.md).
    Both layouts run at the capacity that fits; the ones that did not are listed."""
    capacity, out_of_memory_at = args.capacity, []
    while True:
        try:
            out = bench_model(name, cfg, seqs, args, peak, capacity)
            break
        except torch.cuda.OutOfMemoryError:
            out_of_memory_at.append(capacity)
            if capacity // 2 < args.max_len:
                raise
        gc.collect()  # outside the except block: the traceback no longer pins the policy
        torch.cuda.empty_cache()
        print(f"{name}: out of GPU memory at {capacity} tokens per micro-batch; again at {capacity // 2}", flush=True)
        capacity //= 2
    out["out_of_memory_at"] = out_of_memory_at
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="every section at toy size (CPU test, quick GPU pass)")
    p.add_argument("--tiny", action="store_true", help="only the bench section at toy size")
    p.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections to run")
    p.add_argument("--sizes", default="0.6B,1.7B", help="comma-separated dirs of examples/qwen3_configs")
    p.add_argument("--seqs", type=int, default=64, help="sequences per optimizer step (e.g. 8 prompts x G=8)")
    p.add_argument("--max-len", type=int, default=4096, help="longest sequence (prompt + completion)")
    p.add_argument("--capacity", type=int, default=16384, help="max tokens per micro-batch")
    p.add_argument("--steps", type=int, default=4, help="timed optimizer steps per layout")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--budget-s",
        type=float,
        default=420.0,
        help="wall-clock budget: a bench model whose estimated time no longer fits is skipped",
    )
    p.add_argument("--peak-tflops", type=float, default=0.0, help="override the device peak")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    if args.tiny:
        args.smoke, args.only = True, "bench"
    if args.smoke:
        args.seqs, args.max_len, args.capacity = min(args.seqs, 16), min(args.max_len, 24), min(args.capacity, 64)
        args.steps, args.warmup = min(args.steps, 2), min(args.warmup, 1)
    args.only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(args.only) - set(SECTIONS)
    if unknown:
        p.error(f"--only: unknown section(s) {sorted(unknown)}; expected {', '.join(SECTIONS)}")
    return args


def _estimate_s(cfg, seqs, args, measured: list[dict]) -> float:
    """Seconds a model's bench will take: scaled from the last measured model by FLOPs, else
    assuming 20% MFU; padded does about 1/density-packed-over-padded times the work."""
    flops = profiling.train_flops(vars(cfg), [len(s.tokens) for s in seqs])
    steps = args.warmup + args.steps
    if measured:
        last = measured[-1]
        per_flop = (last["packed"]["step_s"] + last["padded"]["step_s"]) / last["model_flops_per_step"]
        return steps * flops * per_flop + last["build_s"]
    return steps * 4 * flops / (0.2 * 989e12) + 30


def main(argv=None) -> int:
    t_start = time.perf_counter()
    args = parse_args(argv)
    from megatron_dppo.run.collectives import set_launch_env_defaults

    env_set = set_launch_env_defaults()  # what the trainer runs under, set before CUDA starts
    out_path = Path(
        args.out
        or (
            Path(os.environ["OUT"]) / "device_bench.json"
            if os.environ.get("OUT")
            else REPO / "runs" / "device_bench.json"
        )
    )
    from megatron_dppo.megatron import destroy_parallel, initialize_parallel

    initialize_parallel(1, 1, seed=0)
    cuda = torch.cuda.is_available()
    kind = profiling.detect_device()
    peak, source = profiling.device_peak_flops(kind, args.peak_tflops * 1e12 if args.peak_tflops else None)
    result = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "mode": "smoke" if args.smoke else "full",
        "peak_flops": peak,
        "peak_source": source,
        "seqs": args.seqs,
        "max_len": args.max_len,
        "capacity": args.capacity,
        "steps": args.steps,
        "attention": "bench and grad-check: local spec (megatron/attention.py); te: Transformer Engine",
        "launch_env_set": env_set,
        "checks": {},
        "models": [],
        "skipped": [],
        "errors": [],
    }
    if cuda and not args.smoke:  # an achievable bf16 matmul rate beside the data sheet's
        result["matmul_flops_measured"] = profiling.measure_matmul_flops(n=8192, seconds=1.0, device="cuda")
    print(
        f"{result['device']}: peak {peak / 1e12:.2f} TFLOP/s ({source})"
        + (
            f", measured bf16 matmul {result['matmul_flops_measured'] / 1e12:.0f} TFLOP/s"
            if "matmul_flops_measured" in result
            else ""
        ),
        flush=True,
    )
    failed = []

    def save():
        result["wall_s"] = time.perf_counter() - t_start
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(result, indent=1))

    def skip(why: str):
        result["skipped"].append(why)
        print(f"skipped {why}", flush=True)

    def section(name, fn):
        try:
            fn()
        except Exception as e:  # record it and go on: a device lease is too short to stop at the first problem
            failed.append(name)
            result["errors"].append(f"{name}: {type(e).__name__}: {e}")
            print(f"{name} FAILED: {type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}", flush=True)
        save()

    def grad_checks():
        result["checks"]["grad"] = []
        for dtype in (torch.float32, torch.bfloat16):
            r = device_checks.grad_check(dtype)
            r["tolerance"] = GRAD_TOLERANCE[dtype]
            result["checks"]["grad"].append(r)
            if not (r["rel_grad_error"] <= r["tolerance"] and r["update_ok"] and r["max_weight_change"] > 0):
                failed.append(f"grad-check {r['dtype']}")

    def te_grad_checks():
        """The grad check through Transformer Engine's attention, where it can run; else the
        named reason (e.g. no transformer_engine, or float32 on TE < 2.11) is recorded."""
        result["checks"]["grad_te"] = []
        for dtype in (torch.float32, torch.bfloat16):
            blocker = device_checks.te_blocker(dtype)
            if blocker:
                skip(f"te grad-check {str(dtype).replace('torch.', '')}: {blocker}")
                continue
            r = device_checks.grad_check(dtype, attention="te")
            r["tolerance"] = GRAD_TOLERANCE[dtype]
            result["checks"]["grad_te"].append(r)
            if not (r["rel_grad_error"] <= r["tolerance"] and r["update_ok"] and r["max_weight_change"] > 0):
                failed.append(f"te grad-check {r['dtype']}")

    def _grad_ok(r, what: str):
        result["checks"].setdefault(what, []).append(r)
        if not (r["rel_grad_error"] <= r["tolerance"] and r["update_ok"] and r["max_weight_change"] > 0):
            failed.append(f"{what} {r['model']} {r['dtype']}")

    def moe_checks():
        dtype = torch.bfloat16 if cuda else torch.float32
        blocker = device_checks.te_blocker(dtype)
        if blocker:
            skip(f"moe grad-check through te {str(dtype).replace('torch.', '')}: {blocker} (the local path runs)")
        r = device_checks.grad_check(dtype, cfg=device_checks.TOY_MOE, attention="local" if blocker else "te")
        r["tolerance"] = GRAD_TOLERANCE[dtype]
        _grad_ok(r, "grad_moe")
        if importlib.util.find_spec("vllm") is None:
            skip("moe vllm cycle: vllm is not installed (pip install vllm==0.32.0: the gpu extra)")
            return
        with tempfile.TemporaryDirectory(prefix="device_bench_moe_") as work:
            v = device_checks.vllm_cycle(dtype, model_dir=device_checks.tiny_moe_dir(Path(work)))
        v["tolerance"] = VLLM_LOGP_TOLERANCE[dtype]
        result["checks"]["vllm_moe"] = v
        if not v["max_logprob_diff"] <= v["tolerance"]:
            failed.append("vllm moe")

    def family_checks():
        """The grad check of the Llama (llama3 RoPE) and Qwen2 (q/k/v biases) toys, through
        Transformer Engine where it runs (its spec without q/k norms, with the QKV bias), else
        the local path with the reason recorded."""
        dtype = torch.bfloat16 if cuda else torch.float32
        blocker = device_checks.te_blocker(dtype)
        if blocker:
            skip(f"families grad-check through te {str(dtype).replace('torch.', '')}: {blocker} (the local path runs)")
        for cfg in (device_checks.TOY_LLAMA, device_checks.TOY_QWEN2):
            r = device_checks.grad_check(dtype, cfg=cfg, attention="local" if blocker else "te")
            r["tolerance"] = GRAD_TOLERANCE[dtype]
            _grad_ok(r, "grad_families")

    def kl_check():
        dtype = torch.bfloat16 if cuda else torch.float32
        r = device_checks.grad_check(dtype, distributed_optimizer=False, kl_coef=KL_COEF)
        r["tolerance"], r["ref_tolerance"] = GRAD_TOLERANCE[dtype], REF_LOGP_TOLERANCE[dtype]
        _grad_ok(r, "grad_kl")
        if not r["ref_logprob_max_diff"] <= r["ref_tolerance"]:
            failed.append(f"kl reference log-probs {r['dtype']}")

    def vllm_cycle():
        if importlib.util.find_spec("vllm") is None:
            skip("vllm: vllm is not installed (pip install vllm==0.32.0: the gpu extra)")
            return
        dtype = torch.bfloat16 if cuda else torch.float32  # what a GPU run trains in; fp32 on the CPU
        r = device_checks.vllm_cycle(dtype)
        r["tolerance"] = VLLM_LOGP_TOLERANCE[dtype]
        result["checks"]["vllm"] = r
        if not r["max_logprob_diff"] <= r["tolerance"]:
            failed.append("vllm")
        if args.smoke:  # the CPU path of the padded MoE reload runs in tests/dist/test_moe_step.py
            return
        with tempfile.TemporaryDirectory(prefix="device_bench_") as work:
            r = device_checks.padded_moe_vllm_cycle(dtype, Path(work))
        r["tolerance"] = VLLM_LOGP_TOLERANCE[dtype]
        result["checks"]["vllm_padded_moe"] = r
        if not r["max_logprob_diff"] <= r["tolerance"]:
            failed.append("vllm padded MoE")

    def convert():
        cfg = (
            dict(device_checks.TOY)
            if args.smoke
            else device_checks.config_from_file(CONFIGS / "0.6B" / "config.json", num_hidden_layers=2)
        )
        with tempfile.TemporaryDirectory(prefix="device_bench_") as work:
            r = device_checks.convert_and_verify(Path(work), cfg, tolerance=1e-3)
        result["checks"]["convert"] = r
        if not r["ok"]:
            failed.append("convert")

    def bench():
        models = {"tiny": TINY} if args.smoke else {s: CONFIGS / s / "config.json" for s in args.sizes.split(",")}
        for name, path in models.items():
            cfg = hf_config(path)
            seqs = samples(rl_lengths(args.seqs, args.max_len), cfg.vocab_size)
            result["real_tokens"] = sum(len(s.tokens) for s in seqs)
            left = args.budget_s - (time.perf_counter() - t_start)
            need = _estimate_s(cfg, seqs, args, result["models"])
            if not args.smoke and need > left:
                result["skipped"].append(f"bench {name}: needs ~{need:.0f} s, {left:.0f} s left of --budget-s")
                print(result["skipped"][-1], flush=True)
                continue
            result["models"].append(bench_within_memory(name, cfg, seqs, args, peak))
            save()

    sections = {
        "grad-check": grad_checks,
        "te": te_grad_checks,
        "moe": moe_checks,
        "families": family_checks,
        "kl": kl_check,
        "convert": convert,
        "vllm": vllm_cycle,
        "bench": bench,
    }
    try:
        for name in args.only:
            section(name, sections[name])
    finally:
        destroy_parallel()
    result["failed"] = failed
    save()
    print(
        f"wrote {out_path} after {result['wall_s']:.0f} s"
        + (f"; FAILED: {', '.join(failed)}" if failed else "; all checks passed"),
        flush=True,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
