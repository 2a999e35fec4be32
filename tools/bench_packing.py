"""Dense packing, measured: density of the packers, packed-attention speed, and the trainer's
train phase with packed vs padded micro-batches (docs/dppo.md section 6, docs/packing.md).

Every comparison is side by side in ONE run, interleaved (A B A B ...), and printed as a ratio:
timings on a shared machine drift too much to compare across runs.

    .venv/bin/python tools/bench_packing.py                      # all sections
    .venv/bin/python tools/bench_packing.py --sections attention # one layer's attention only
    .venv/bin/python tools/bench_packing.py --sections trainer --trainer-steps 6 --rounds 2

Sections:
  density    padded batching (rows padded to the batch's longest; and per micro-batch), first-fit-
             decreasing and the window greedy at several windows on RL-shaped lengths (B prompts
             of 80-300 tokens, G log-normal completions, half of each group pruned): micro-batches,
             density, packing time, and the DP imbalance after balance_packs.
  attention  one layer's core attention, forward + backward, per REAL token, through
             megatron/attention.py's kernels: the per-sequence loop, the length buckets, and
             padded rows (the [rows, longest] batch `trainer.packing=padded` runs); on a uniform
             micro-batch (the addition task's lengths) and a long-tailed one (the mulsteps
             task's), tiny-model heads (4 query / 2 KV x 32).
  profile    torch.profiler over MegatronPolicy.train_step on one process (the trainer's packed
             micro-batches of the addition and the long-tailed task): the top ops by self CPU
             time, and how much of the step is not inside an ATen kernel (Python, autograd,
             dispatch) per micro-batch; and forward_backward with the CPU shim's device-
             rewriting TorchFunctionMode (megatron/cpu_compat.py) pushed back into the model's
             forward, which MegatronPolicy._forward_step runs without it, to price that.
  trainer    `megatron-dppo train` through the CLI, interleaved, same seed: time/train per step
             (runs/<name>/metrics.jsonl, first step dropped) with trainer.packing=window vs
             padded, and window packing with the per-sequence loop attention (the code before
             the buckets: model.thd_attention=loop) vs the default, on the addition and
             the long-tailed task.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from megatron_dppo.algorithms.packing import balance_packs, density, dp_imbalance, pack, pack_ffd, pack_padded  # noqa: E402

TASK_CONFIGS = {"addition": "examples/tiny/addition.yaml", "longtail": "examples/tiny/longtail.yaml"}


def timed(fn, *args, repeat=3):
    """(result, best wall ms of `repeat` runs): the minimum filters GC pauses and noise."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn(*args)
        best = min(best, 1e3 * (time.perf_counter() - t0))
    return out, best


# ------------------------------------------------------------------------------------ density


def rollout_lengths(rng, prompts, group, max_response, median, sigma, keep_frac):
    prompt = rng.integers(80, 301, size=prompts)
    completion = np.clip(rng.lognormal(np.log(median), sigma, size=(prompts, group)), 1, max_response)
    lengths = []
    for q in range(prompts):
        kept = np.sort(rng.choice(group, size=int(round(group * keep_frac)), replace=False))
        lengths += [int(prompt[q] + completion[q, i]) for i in kept]
    return lengths


def section_density(args) -> dict:
    lengths = rollout_lengths(
        np.random.default_rng(args.seed),
        args.prompts,
        args.group,
        args.max_response,
        args.median,
        args.sigma,
        args.keep,
    )
    n = len(lengths)
    print(
        f"== density: {n} sequences ({args.prompts} prompts x {args.group}, keep {args.keep}); length "
        f"mean {np.mean(lengths):.0f} median {np.median(lengths):.0f} max {max(lengths)}, "
        f"{sum(lengths)} tokens; dp={args.dp}"
    )
    methods = [
        ("padded", lambda c: pack_padded(lengths, c)),
        ("padded/mb", lambda c: pack_padded(lengths, c, per_microbatch=True)),
        ("ffd", lambda c: pack_ffd(lengths, c)),
    ]
    methods += [(f"window={w}", lambda c, w=w: pack(lengths, c, w)) for w in args.windows]
    methods += [("window=all", lambda c: pack(lengths, c, n))]
    results = []
    for cap in args.capacities:
        print(f"\ncapacity {cap}")
        print(f"  {'method':<12}{'micro-batches':>14}{'density':>9}{'pack ms':>9}{'mb/rank':>9}{'dp imbalance':>14}")
        for name, fn in methods:
            packs, ms = timed(fn, cap)
            ranks = balance_packs(packs, lengths, args.dp)
            row = dict(
                capacity=cap,
                method=name,
                micro_batches=len(packs),
                density=density(lengths, packs, cap),
                pack_ms=ms,
                mb_per_rank=len(ranks[0]),
                dp_imbalance=dp_imbalance(ranks, lengths),
            )
            results.append(row)
            print(
                f"  {name:<12}{row['micro_batches']:>14}{row['density']:>9.4f}{ms:>9.1f}"
                f"{row['mb_per_rank']:>9}{row['dp_imbalance']:>14.4f}"
            )
    big = rollout_lengths(
        np.random.default_rng(args.seed + 1), 2500, args.group, args.max_response, args.median, args.sigma, args.keep
    )
    timing = {w: timed(pack, big, args.capacities[0], w)[1] for w in [*args.windows, len(big)]}
    print(
        f"\npack() on {len(big)} sequences, capacity {args.capacities[0]}: "
        + ", ".join(f"window={w if w < len(big) else 'all'} {ms:.0f} ms" for w, ms in timing.items())
    )
    return dict(num_sequences=n, results=results, pack_ms_10k={str(w): ms for w, ms in timing.items()})


# ---------------------------------------------------------------------------------- attention


def task_lengths(task: str, rng: random.Random, n: int) -> list[int]:
    """Sequence lengths (<bos> + prompt + completion + <eos>) of n problems of a bundled task,
    completions at their worked-solution / answer length (what a warmed-up model emits)."""
    from megatron_dppo.data.tasks import get_task

    t = get_task(task)
    out = []
    for _ in range(n):
        a, b = t.draw(rng)
        r = t.record(a, b)
        out.append(1 + len(r["prompt"]) + len(r.get("solution", r["answer"])) + 1)
    return out


def fill(lengths, capacity):
    """The first sequences that fit one micro-batch of `capacity` tokens."""
    out, used = [], 0
    for n in lengths:
        if used + n > capacity:
            break
        out.append(n)
        used += n
    return out


def section_attention(args) -> dict:
    import torch
    import torch.nn.functional as F

    from megatron_dppo.megatron.attention import BUCKET_CALL_COST, PackedRow, bucketed_attention, loop_attention

    torch.set_num_threads(args.threads)
    hq, hk, d = 4, 2, 32
    rng = random.Random(args.seed)
    cases = {
        "uniform (add3)": fill(task_lengths("add3", rng, 4000), args.attn_capacity),
        "long-tailed (mulsteps)": fill(task_lengths("mulsteps", rng, 4000), args.attn_capacity),
    }
    print(
        f"\n== attention: one layer, forward + backward, {hq} query / {hk} KV heads x {d}, fp32, "
        f"{args.threads} thread(s), micro-batch of <= {args.attn_capacity} tokens; "
        f"median of {args.rounds * 5} interleaved timings (process CPU time), microseconds per real token"
    )
    results = {}
    for name, lengths in cases.items():
        total = sum(lengths)
        cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
        row = PackedRow.from_cu(cu, None, total)
        width = max(lengths)

        rows = len(lengths)

        def padded(q, k, v, rows=rows, width=width):
            # [rows, width] right-padded rows under a causal mask, as build_padded_batch lays them
            # out and PackedDotProductAttention._forward_bshd runs them: Megatron hands [s, b, h, d]
            qs, ks, vs = (x.unflatten(0, (width, rows)).permute(1, 2, 0, 3) for x in (q, k, v))
            out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
            return out.permute(2, 0, 1, 3).reshape(width, rows, -1)

        impls = {
            "loop": (lambda q, k, v, row=row: loop_attention(q, k, v, row, scale=d**-0.5), total),
            "bucketed": (lambda q, k, v, row=row: bucketed_attention(q, k, v, row, scale=d**-0.5), total),
            "padded rows": (padded, len(lengths) * width),
        }
        inputs = {}
        for impl, (_, tokens) in impls.items():
            g = torch.Generator().manual_seed(0)
            inputs[impl] = [torch.randn(tokens, h, d, generator=g).requires_grad_() for h in (hq, hk, hk)]
        times = {impl: [] for impl in impls}
        for r in range(args.rounds * 5):
            order = list(impls) if r % 2 == 0 else list(reversed(impls))
            for impl in order:
                fn, _ = impls[impl]
                qkv = inputs[impl]
                if r == 0:
                    fn(*qkv).sum().backward()  # warm-up
                t0 = time.process_time()  # CPU time: other jobs on a shared machine do not count
                fn(*qkv).sum().backward()
                times[impl].append(time.process_time() - t0)
        per_token = {impl: 1e6 * statistics.median(t) / total for impl, t in times.items()}
        buckets = len(row.bucket_plan("cpu", BUCKET_CALL_COST / (hq * d)).shapes)
        print(
            f"  {name}: {len(lengths)} sequences, {total} real tokens, lengths median "
            f"{statistics.median(lengths):.0f} max {width}; {buckets} bucket(s); padded rows hold "
            f"{len(lengths) * width} tokens"
        )
        for impl, us in per_token.items():
            print(f"    {impl:<12} {us:8.3f} us/token   {us / per_token['bucketed']:6.2f}x bucketed")
        results[name] = dict(
            sequences=len(lengths),
            real_tokens=total,
            max_len=width,
            buckets=buckets,
            us_per_real_token=per_token,
            loop_over_bucketed=per_token["loop"] / per_token["bucketed"],
            padded_over_bucketed=per_token["padded rows"] / per_token["bucketed"],
        )
    return results


# ------------------------------------------------------------------------------------ profile


def tiny_train_batches(task: str, hf_dir: str, vocab: int, packing: str, capacity: int, seed: int):
    """The micro-batches a DPPO step of the tiny job trains: 32 prompts x 8 completions at the
    task's lengths, a random half of each group kept (r_o = 0.5), packed as the trainer does."""
    from megatron_dppo.algorithms import packing as pk

    rng = random.Random(seed)
    samples = []
    for _ in range(32):
        group = task_lengths(task, rng, 8)
        for i in sorted(rng.sample(range(8), 4)):
            n = group[i]
            prompt = min(n - 1, 9)
            samples.append(
                pk.Sample(
                    tokens=[rng.randint(3, vocab - 1) for _ in range(n)],
                    prompt_len=prompt,
                    advantage=rng.uniform(-1, 1),
                    weight=2.0,
                    seq_id=len(samples),
                )
            )
    lengths = [len(s.tokens) for s in samples]
    if packing == "padded":
        return [pk.build_padded_batch([samples[i] for i in p]) for p in pk.pack_padded(lengths, capacity)]
    return [pk.build_thd_batch([samples[i] for i in p]) for p in pk.pack(lengths, capacity, 16)]


def section_profile(args) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoConfig

    from megatron_dppo.config import AlgorithmConfig, OptimConfig
    from megatron_dppo.megatron import cpu_compat, initialize_parallel
    from megatron_dppo.megatron.policy import MegatronPolicy

    torch.set_num_threads(args.threads)
    initialize_parallel(1, 1, args.seed)
    results = {}
    for task, hf_dir in (("add3", "examples/tiny/model"), ("mulsteps", "examples/tiny/longtail/model")):
        cfg = AutoConfig.from_pretrained(os.path.join(REPO, hf_dir))
        policy = MegatronPolicy(cfg, OptimConfig(lr=1e-6), AlgorithmConfig())
        batches = tiny_train_batches(task, hf_dir, cfg.vocab_size, "window", 1024, args.seed)
        tokens = sum(int(b.tokens.numel()) for b in batches)
        policy.train_step(batches, denominator=float(tokens))  # warm-up
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()  # wall, like the profiler's own times
            for _ in range(3):
                policy.train_step(batches, denominator=float(tokens))
            step_s = (time.perf_counter() - t0) / 3
        events = prof.key_averages()
        aten_s = sum(e.self_cpu_time_total for e in events if e.key.startswith(("aten::", "c10d::"))) / 1e6 / 3
        calls = sum(e.count for e in events if e.key.startswith("aten::")) / 3
        top = sorted(events, key=lambda e: -e.self_cpu_time_total)[: args.top_ops]
        print(
            f"\n== profile: MegatronPolicy.train_step, {task}, {len(batches)} packed micro-batch(es) of <= 1024 "
            f"tokens ({tokens} tokens), {args.threads} thread(s)"
        )
        print(
            f"  step {1e3 * step_s:.1f} ms (profiled); inside ATen/c10d ops {1e3 * aten_s:.1f} ms "
            f"({100 * aten_s / step_s:.0f}%); the rest (Python, autograd, dispatch, the CPU shim) "
            f"{1e3 * (step_s - aten_s) / len(batches):.1f} ms per micro-batch; {calls / len(batches):.0f} "
            f"ATen calls per micro-batch"
        )
        total = sum(e.self_cpu_time_total for e in events)
        for e in top:
            print(f"    {e.key[:60]:<60} {100 * e.self_cpu_time_total / total:5.1f}%  {e.count // 3:6d} calls/step")
        # The CPU shim's device-rewriting TorchFunctionMode runs Python on every torch call.
        # MegatronPolicy._forward_step lifts it around the model's forward (the built model
        # allocates nothing on "cuda"); price that by pushing the mode back inside the forward.
        forward = policy.model.forward

        def with_shim(*a, forward=forward, **k):
            with cpu_compat._MODE:
                return forward(*a, **k)

        shim = {"with shim": [], "shim lifted": []}
        for r in range(2 * args.rounds):
            for mode in shim if r % 2 == 0 else reversed(list(shim)):
                policy.model.forward = with_shim if mode == "with shim" else forward
                t0 = time.process_time()
                policy.forward_backward(batches, denominator=float(tokens))
                shim[mode].append(time.process_time() - t0)
        policy.model.forward = forward
        fb = {k: statistics.median(v) for k, v in shim.items()}
        print(
            f"  forward_backward (CPU time): {1e3 * fb['with shim']:.1f} ms with the CPU shim's TorchFunctionMode "
            f"in the model's forward, {1e3 * fb['shim lifted']:.1f} ms without it (what _forward_step does) "
            f"({fb['with shim'] / fb['shim lifted']:.2f}x)"
        )
        results[task] = dict(
            step_ms=1e3 * step_s,
            aten_ms=1e3 * aten_s,
            micro_batches=len(batches),
            overhead_ms_per_microbatch=1e3 * (step_s - aten_s) / len(batches),
            aten_calls_per_microbatch=calls / len(batches),
            top_ops=[(e.key, e.self_cpu_time_total / total, e.count // 3) for e in top],
            forward_backward_ms={k: 1e3 * v for k, v in fb.items()},
        )
    return results


# ------------------------------------------------------------------------------------ trainer


def run_train(config: str, name: str, steps: int, overrides: list[str], env_extra: dict, threads: int) -> list[dict]:
    """One CLI run; returns its metrics.jsonl records."""
    out_dir = os.path.join(REPO, "runs", name)
    shutil.rmtree(out_dir, ignore_errors=True)
    cmd = [
        os.path.join(REPO, ".venv", "bin", "megatron-dppo"),
        "train",
        "--config",
        config,
        f"trainer.max_steps={steps}",
        f"trainer.run_name={name}",
        "logging.wandb=disabled",
        "logging.progress=false",
        "trainer.eval_every=0",
        f"trainer.save_every={10 * steps}",
        f"trainer.threads={threads}",
        "trainer.max_time_s=0",
        *overrides,
    ]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), **env_extra)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def section_trainer(args) -> dict:
    variants = {  # name -> (config overrides, environment)
        "window": (["trainer.packing=window"], {}),
        "padded": (["trainer.packing=padded"], {}),
        "window+loop-attention": (["trainer.packing=window", "model.thd_attention=loop"], {}),
    }
    print(
        f"\n== trainer: {args.trainer_steps} steps a run (step 1 dropped), {args.rounds} interleaved "
        f"round(s), {args.threads} thread(s), seed 0; time/train summed over the kept steps"
    )
    results = {}
    for task in args.tasks:
        config = TASK_CONFIGS[task]
        steps = {v: [] for v in variants}  # per round: the kept steps' time/train
        density_of = {v: [] for v in variants}
        for r in range(args.rounds):
            order = list(variants) if r % 2 == 0 else list(reversed(variants))
            for v in order:
                overrides, env = variants[v]
                name = f"bench-packing-{task}-{v.replace('+', '-')}"
                records = run_train(config, name, args.trainer_steps, overrides, env, args.threads)[1:]
                steps[v].append([m["time/train"] for m in records])
                density_of[v].append(statistics.mean(m["pack/density"] for m in records))
                print(
                    f"  {task} round {r + 1} {v:<22} time/train {sum(steps[v][-1]):7.3f} s "
                    f"(median step {1e3 * statistics.median(steps[v][-1]):6.1f} ms)  "
                    f"pack/density {density_of[v][-1]:.3f}",
                    flush=True,
                )

        def ratio(a, b, how, steps=steps):
            per_round = [how(x) / how(y) for x, y in zip(steps[a], steps[b])]
            return statistics.median(per_round), per_round

        # The sum carries the garbage collector's pauses (0.3-0.7 s gen-2 collections land in
        # random steps of either variant); the median step is robust to them.
        out = {}
        for label, a in (("padded / window", "padded"), ("loop attention / buckets", "window+loop-attention")):
            for how_name, how in (("sum", sum), ("median step", statistics.median)):
                med, rounds = ratio(a, "window", how)
                out[f"{label} ({how_name})"] = dict(median=med, rounds=rounds)
                print(f"  {task}: {label} = {med:.2f}x by {how_name} (rounds: {', '.join(f'{x:.2f}' for x in rounds)})")
        results[task] = dict(time_train_s=steps, density=density_of, ratios=out)
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--sections",
        nargs="+",
        default=["density", "attention", "profile", "trainer"],
        choices=["density", "attention", "profile", "trainer"],
    )
    ap.add_argument("--prompts", type=int, default=1024)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-response", type=int, default=4096)
    ap.add_argument("--median", type=float, default=600.0, help="median completion length")
    ap.add_argument("--sigma", type=float, default=0.8, help="log-normal sigma (tail weight)")
    ap.add_argument("--keep", type=float, default=0.5, help="fraction of completions kept")
    ap.add_argument("--capacities", type=int, nargs="+", default=[4608, 8192, 16384])
    ap.add_argument("--windows", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--attn-capacity", type=int, default=1024, help="tokens of the attention micro-batch")
    ap.add_argument("--tasks", nargs="+", default=list(TASK_CONFIGS), choices=list(TASK_CONFIGS))
    ap.add_argument("--trainer-steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--top-ops", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()

    out = {"args": vars(args)}
    for section in args.sections:
        out[section] = {
            "density": section_density,
            "attention": section_attention,
            "profile": section_profile,
            "trainer": section_trainer,
        }[section](args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
