#!/usr/bin/env python
"""Per-phase step times, tokens/s, MFU and GRPO vs DPPO step time, measured side by side.

    .venv/bin/python tools/profile_throughput.py --config examples/tiny/addition.yaml --steps 10
    .venv/bin/python tools/profile_throughput.py --config examples/tiny/addition.yaml --steps 4 \\
        --trace runs/profile/trace data.train_size=64          # + a torch profiler chrome trace
    --nproc 2       each method under torchrun with 2 processes (per-GPU numbers are per rank)
    --peak-tflops   the device peak, overriding the table / the CPU matmul measurement

GRPO = the config with pruning.strategy=none r_q=r_o=0 (--grpo adds overrides); DPPO = the
config with pruning.strategy=dppo (--dppo, default r_q=r_o=0.5). Dotted overrides after the
options apply to both.

How the two are measured side by side. Megatron's parallel state (and vLLM's) is process-global,
so one process cannot hold two Trainers. Each method gets its own worker process (started once:
Megatron + vLLM start-up is not measured) and the workers TAKE TURNS: the coordinator (this
script) lets GRPO run step k, then DPPO step k, then DPPO step k+1, then GRPO step k+1 (the order
alternates so neither is always first). Only one step runs at a time, so the two never compete
for the cores, and both see the same background load, interleaved at step granularity: what
other jobs on the machine do is noise shared by both columns, not a bias against one. Turns are
files in <out>/handshake (go/<method>-<step>, done/<method>-<step>.json), which also works for
every rank of a torchrun worker.

Per step the worker records the sequence lengths the policy trained on (and computed log-probs
for) and the prompt/completion lengths vLLM generated, and turns them into model FLOPs with
megatron_dppo.run.profiling (formula: docs/profiling.md). MFU = model FLOPs / (phase seconds x
peak x model-parallel size), per GPU. The first --warmup steps (allocator, vLLM warm-up, empty
prompt history) are run but not summarised. GRPO/DPPO step time is given three ways: ratio of
means (what a run costs), of medians, and the median of per-pair ratios (GRPO step k / DPPO step
k, adjacent in time: the estimator the turn-taking is built for, robust to other jobs' bursts).
On a CPU the peak is a matmul rate measured between step pairs, best kept (docs/profiling.md).

Writes <out>/profile.json and <out>/profile.png (phase-time stacked bars, GRPO vs DPPO).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_dppo.run import profiling  # noqa: E402  (plain arithmetic; no torch at import)
from megatron_dppo.run.process import free_port  # noqa: E402

METHODS = {  # method -> overrides on top of the config and the common overrides
    "grpo": ["pruning.strategy=none", "pruning.r_q=0", "pruning.r_o=0"],
    "dppo": ["pruning.strategy=dppo", "pruning.r_q=0.5", "pruning.r_o=0.5"],
}
# Profiling runs: no evaluation, no logging side channels (Trainer.step never checkpoints).
QUIET = ["trainer.eval_every=0", "logging.wandb=disabled", "logging.progress=false", "logging.tensorboard=false"]


# ---- worker: one method, one Trainer, steps on demand ---------------------------------------------
class Recorder:
    """Wraps the policy's train/log-prob calls and the engine's generate to see the lengths the
    step really processed (on this rank), without touching the trainer's code."""

    def __init__(self, trainer):
        self.hf = trainer.hf_config
        self.reset()
        policy, engine = trainer.policy, trainer.engine
        train_step, logprobs, generate = policy.train_step, policy.compute_logprobs, engine.generate

        def _train_step(microbatches, denominator):
            self.train += _lengths(microbatches)
            return train_step(microbatches, denominator)

        def _logprobs(microbatches, reference=False):
            self.logprob += _lengths(microbatches)
            return logprobs(microbatches, reference=reference)

        def _generate(prompts, n, **kw):
            outs = generate(prompts, n=n, **kw)
            self.generated += [(len(p), [len(c.token_ids) for c in group]) for p, group in zip(prompts, outs)]
            return outs

        policy.train_step, policy.compute_logprobs, engine.generate = _train_step, _logprobs, _generate

    def reset(self):
        self.train, self.logprob, self.generated = [], [], []

    def stats(self) -> dict:
        gen = self.generated
        return {
            "flops/train": profiling.train_flops(self.hf, self.train),
            "flops/logprob": profiling.forward_flops(self.hf, self.logprob),
            "flops/rollout": sum(profiling.generation_flops(self.hf, p, c) for p, c in gen),
            "rank/tokens_trained": sum(self.train),
            "rank/seqs_trained": len(self.train),
            "rank/max_seq_len": max(self.train, default=0),
            "rank/tokens_generated": sum(sum(c) for _, c in gen),
            # all rolled-out sequences, prompt included (NeMo-RL's tokens/s/GPU counts these)
            "rank/tokens_rollout": sum(p * len(c) + sum(c) for p, c in gen),
        }


def _lengths(microbatches) -> list[int]:
    """Real (unpadded) length of every sequence of packed or padded micro-batches."""
    out = []
    for mb in microbatches:  # seq_index numbers the sequences of a micro-batch (-1 on padding)
        idx = mb.seq_index.flatten()
        out += idx[idx >= 0].bincount().tolist()
    return [n for n in out if n > 0]


def _wait_for(path: Path, stop: Path, timeout: float = 3600.0) -> None:
    t_end = time.time() + timeout
    while not path.exists():
        # the coordinator asked us to stop, died (we were re-parented), or forgot us
        if stop.exists() or os.getppid() == 1 or time.time() > t_end:
            raise SystemExit(f"worker: gave up waiting for {path.name}")
        time.sleep(0.01)


def worker(args) -> int:
    import torch

    from megatron_dppo.config import load_config
    from megatron_dppo.train.trainer import Trainer

    hs = Path(args.handshake)
    name, rank = args.worker, int(os.environ.get("RANK", "0"))
    total = args.warmup + args.steps + (args.trace_steps if args.trace else 0)
    cfg = load_config(args.config, [*args.overrides, f"trainer.max_steps={total}", "trainer.max_time_s=0"])
    trainer = Trainer(cfg)
    rec = Recorder(trainer)
    mp = trainer.cfg.parallel.tp * trainer.cfg.parallel.pp
    if rank == 0:
        (hs / f"ready-{name}").write_text(
            json.dumps({"world": trainer.world, "model_parallel": mp, "engine_init_s": trainer.engine_init_s})
        )
    prof = None
    try:
        for step in range(1, total + 1):
            _wait_for(hs / "go" / f"{name}-{step}", hs / "stop")
            traced = args.trace and step > args.warmup + args.steps
            if traced and prof is None:
                acts = [torch.profiler.ProfilerActivity.CPU]
                if torch.cuda.is_available():
                    acts.append(torch.profiler.ProfilerActivity.CUDA)
                prof = torch.profiler.profile(activities=acts, record_shapes=True)
                prof.start()
            rec.reset()
            with torch.profiler.record_function(f"{name} step {step}"):
                m = trainer.step(step)
            m.update(rec.stats(), traced=bool(traced))
            if rank == 0:
                tmp = hs / "done" / f".{name}-{step}.tmp"
                tmp.write_text(json.dumps(m))
                tmp.rename(hs / "done" / f"{name}-{step}.json")  # atomic: the coordinator never reads half
        if prof is not None:
            prof.stop()
            os.makedirs(args.trace, exist_ok=True)
            prof.export_chrome_trace(os.path.join(args.trace, f"{name}-rank{rank}.json"))
        while not (hs / "stop").exists():  # shutting down now would slow the other method's last step
            time.sleep(0.05)
    finally:
        trainer.close()
    return 0


# ---- coordinator -------------------------------------------------------------------------------
def _spawn(args, name: str, out: Path, hs: Path) -> subprocess.Popen:
    overrides = [
        *args.overrides,
        *QUIET,
        *METHODS[name],
        *shlex.split(getattr(args, name)),
        f"trainer.output_dir={out / 'runs'}",
        f"trainer.run_name={name}",
    ]
    me = [
        str(Path(__file__).resolve()),
        "--worker",
        name,
        "--handshake",
        str(hs),
        "--config",
        args.config,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--trace-steps",
        str(args.trace_steps),
    ]
    if args.trace:
        me += ["--trace", str(Path(args.trace).resolve())]
    launcher = [sys.executable]
    if args.nproc > 1:
        launcher += [
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={args.nproc}",
            "--master_addr=127.0.0.1",
            f"--master_port={free_port()}",
        ]
    log = open(out / f"{name}.log", "w")
    return subprocess.Popen(
        [*launcher, *me, *overrides],
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=dict(os.environ, PYTHONWARNINGS="ignore"),
    )


def _await(path: Path, procs: dict, out: Path, timeout: float) -> None:
    t_end = time.time() + timeout
    while not path.exists():
        for name, p in procs.items():
            if p.poll() is not None:
                tail = (out / f"{name}.log").read_text()[-4000:]
                raise RuntimeError(f"{name} worker exited with {p.returncode} before {path.name}:\n{tail}")
        if time.time() > t_end:
            raise TimeoutError(f"no {path.name} after {timeout:.0f}s")
        time.sleep(0.01)


def summarize(steps: list[dict], peak: float, world: int, mp: int) -> dict:
    """Means over the measured steps of one method: phases, throughput, MFU, packing, pruning."""
    n = len(steps)

    def mean(key):
        return sum(s.get(key, 0.0) for s in steps) / n

    ph = profiling.summarize_phases(steps)
    flops = {k: mean(f"flops/{k}") for k in ("rollout", "logprob", "train")}
    gpu_peak = peak * mp  # a rank's FLOPs are its model-parallel group's share
    return {
        "steps": n,
        "phases_s": ph,  # means: what a run of these steps costs
        # the median step resists another job's burst on a shared machine
        "step_s_median": statistics.median(s["time/step"] for s in steps),
        "tokens_per_step": {
            "generated": mean("tokens/generated"),
            "trained": mean("tokens/trained"),
            "rank_rollout": mean("rank/tokens_rollout"),
            "rank_trained": mean("rank/tokens_trained"),
        },
        "tokens_per_s_per_gpu": {
            # NeMo-RL style: every rolled-out token (prompt + completion) over the whole step
            "step": mean("rank/tokens_rollout") / ph["step"],
            "generation": mean("rank/tokens_generated") / ph["rollout"] if ph["rollout"] else 0.0,
            "train": mean("rank/tokens_trained") / ph["train"] if ph["train"] else 0.0,
        },
        "model_flops_per_step": flops,
        "mfu": {
            "train": profiling.mfu(flops["train"], ph["train"], gpu_peak),
            "logprob": profiling.mfu(flops["logprob"], ph["logprob"], gpu_peak),
            "rollout": profiling.mfu(flops["rollout"], ph["rollout"], gpu_peak),
            "step": profiling.mfu(sum(flops.values()), ph["step"], gpu_peak),
        },
        "pack_density": mean("pack/density"),
        "prompts_kept_frac": mean("prune/prompts_kept_frac"),
        "completions_kept_frac": mean("prune/completions_kept_frac"),
        "completions_pruned_frac": mean("prune/completions_pruned_frac"),
        "zero_variance_frac": mean("groups/zero_variance_frac"),
        "reward_mean": mean("reward/mean"),
        "world": world,
    }


def chart(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["methods"])
    fig, ax = plt.subplots(figsize=(5.5, 4.5))
    bottom = [0.0] * len(names)
    for phase in (*profiling.PHASES, "other"):
        vals = [result["methods"][n]["phases_s"][phase] for n in names]
        ax.bar([n.upper() for n in names], vals, bottom=bottom, label=phase, width=0.55)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, n in enumerate(names):
        m = result["methods"][n]
        ax.text(
            i,
            bottom[i],
            f"mean {m['phases_s']['step']:.3f}s, median {m['step_s_median']:.3f}s\n"
            f"MFU train {100 * m['mfu']['train']:.1f}%",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_ylim(0, max(bottom) * 1.25)
    ax.set_ylabel("mean seconds per step")
    ax.set_title(
        f"{Path(result['config']).name}, {result['steps']} steps each: GRPO / DPPO step time\n"
        f"{result['speedup']:.2f}x mean, {result['speedup_median']:.2f}x median, "
        f"{result['speedup_paired_median']:.2f}x median of pairs",
        fontsize=9,
    )
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def coordinate(args) -> int:
    from megatron_dppo.config import load_config

    load_config(args.config, args.overrides)  # a bad config fails here, not in two workers
    out = Path(args.out).resolve()
    hs = out / "handshake"
    if hs.exists():
        import shutil

        shutil.rmtree(hs)
    (hs / "go").mkdir(parents=True)
    (hs / "done").mkdir()

    kind = args.device or profiling.detect_device()
    # A CPU's peak is measured here with the trainer's thread count: once now, then again between
    # step pairs (never during a step), keeping the best. On a shared machine a single short
    # measurement can land in someone else's burst and come out 10x low (seen: 0.006 vs 0.07
    # TFLOP/s); the best over the whole run is what the cores can do when they are ours.
    sample_peak = kind == "cpu" and not args.peak_tflops
    if sample_peak:
        import torch

        threads = load_config(args.config, args.overrides).trainer.threads
        if threads:
            torch.set_num_threads(threads)
    peak, peak_source = profiling.device_peak_flops(kind, args.peak_tflops * 1e12 if args.peak_tflops else None)
    if sample_peak:
        peak_source = (
            f"cpu: best 1024x1024 fp32 matmul rate, sampled between step pairs, {threads or 'default'} thread(s)"
        )
    print(f"device {kind}: peak {peak / 1e12:.3f} TFLOP/s at start ({peak_source})", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a SystemExit: the except below stops the workers

    names = list(METHODS)
    procs = {n: _spawn(args, n, out, hs) for n in names}
    total = args.warmup + args.steps + (args.trace_steps if args.trace else 0)
    steps = {n: [] for n in names}
    try:
        info = {}
        for n in names:  # start-up runs concurrently; it is not measured
            _await(hs / f"ready-{n}", procs, out, args.timeout)
            info[n] = json.loads((hs / f"ready-{n}").read_text())
        for step in range(1, total + 1):
            for n in names if step % 2 else names[::-1]:  # alternate who goes first
                (hs / "go" / f"{n}-{step}").touch()
                _await(hs / "done" / f"{n}-{step}.json", {n: procs[n]}, out, args.timeout)
                m = json.loads((hs / "done" / f"{n}-{step}.json").read_text())
                steps[n].append(m)
                print(
                    f"step {step:3d} {n}: {m['time/step']:.3f}s (rollout {m['time/rollout']:.3f} "
                    f"train {m['time/train']:.3f} sync {m['time/sync']:.3f})",
                    flush=True,
                )
            if sample_peak:
                peak = max(peak, profiling.measure_matmul_flops(seconds=0.2))
    except BaseException:
        _stop(hs, procs)
        raise
    (hs / "stop").touch()  # the workers close their Trainers while the summary and chart are made

    measured = {n: [s for s in steps[n][args.warmup :] if not s["traced"]] for n in names}
    result = {
        "config": args.config,
        "overrides": args.overrides,
        "method_overrides": {n: METHODS[n] + shlex.split(getattr(args, n)) for n in names},
        "device": kind,
        "peak_flops": peak,
        "peak_source": peak_source,
        "flop_formula": "forward/token = 2*N_matmul + 4*n_layers*n_heads*head_dim*(i+1) at position i; "
        "train = 3x forward; N_matmul excludes the embedding lookup, includes the head "
        "(docs/profiling.md)",
        "steps": args.steps,
        "warmup": args.warmup,
        "engine_init_s": {n: info[n]["engine_init_s"] for n in names},
        "methods": {n: summarize(measured[n], peak, info[n]["world"], info[n]["model_parallel"]) for n in names},
        "per_step": steps,
    }
    g, d = (result["methods"][n]["phases_s"]["step"] for n in ("grpo", "dppo"))
    result["speedup"] = g / d if d else 0.0  # GRPO / DPPO mean step time
    g, d = (result["methods"][n]["step_s_median"] for n in ("grpo", "dppo"))
    result["speedup_median"] = g / d if d else 0.0
    # The turns pair GRPO's step k with DPPO's step k (adjacent in time): the median of the
    # per-pair ratios uses that, a burst of load hitting one pair moves one ratio only.
    pairs = [a["time/step"] / b["time/step"] for a, b in zip(measured["grpo"], measured["dppo"])]
    result["speedup_paired_median"] = statistics.median(pairs) if pairs else 0.0
    (out / "profile.json").write_text(json.dumps(result, indent=1))
    chart(result, out / "profile.png")
    print(report(result))
    print(
        f"wrote {out / 'profile.json'} and {out / 'profile.png'}" + (f"; traces in {args.trace}" if args.trace else "")
    )
    _stop(hs, procs)
    return 0


def _stop(hs: Path, procs: dict) -> None:
    """Ask the workers to close their Trainers and exit; kill (only) our own workers' process
    groups if they do not."""
    (hs / "stop").touch()
    for p in procs.values():
        try:
            p.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def report(result: dict) -> str:
    rows = [
        ("step s (median)", lambda m: m["step_s_median"], "{:.3f}"),
        ("step s (mean)", lambda m: m["phases_s"]["step"], "{:.3f}"),
    ]
    rows += [(f"  {p} s", lambda m, p=p: m["phases_s"][p], "{:.3f}") for p in (*profiling.PHASES, "other")]
    rows += [
        ("tokens/s/GPU step", lambda m: m["tokens_per_s_per_gpu"]["step"], "{:.0f}"),
        ("tokens/s/GPU generation", lambda m: m["tokens_per_s_per_gpu"]["generation"], "{:.0f}"),
        ("tokens/s/GPU train", lambda m: m["tokens_per_s_per_gpu"]["train"], "{:.0f}"),
        ("MFU train %", lambda m: 100 * m["mfu"]["train"], "{:.2f}"),
        ("MFU rollout %", lambda m: 100 * m["mfu"]["rollout"], "{:.2f}"),
        ("MFU step %", lambda m: 100 * m["mfu"]["step"], "{:.2f}"),
        ("pack density", lambda m: m["pack_density"], "{:.3f}"),
        ("prompts kept", lambda m: m["prompts_kept_frac"], "{:.3f}"),
        ("completions trained", lambda m: m["completions_kept_frac"], "{:.3f}"),
        ("tokens trained/step", lambda m: m["tokens_per_step"]["trained"], "{:.0f}"),
    ]
    ms = result["methods"]
    lines = [f"{'':26s}" + "".join(f"{n.upper():>10s}" for n in ms)]
    for label, get, fmt in rows:
        lines.append(f"{label:26s}" + "".join(f"{fmt.format(get(m)):>10s}" for m in ms.values()))
    lines.append(
        f"GRPO/DPPO step time: {result['speedup']:.2f}x mean, {result['speedup_median']:.2f}x median, "
        f"{result['speedup_paired_median']:.2f}x median of step pairs, "
        f"over {result['steps']} steps each "
        f"(peak {result['peak_flops'] / 1e12:.3f} TFLOP/s, {result['peak_source']})"
    )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--steps", type=int, default=10, help="measured steps per method")
    p.add_argument("--warmup", type=int, default=1, help="steps run first and not summarised")
    p.add_argument("--out", default="runs/profile")
    p.add_argument("--grpo", default="", help="extra overrides for GRPO (quoted, space-separated)")
    p.add_argument("--dppo", default="", help="extra overrides for DPPO, e.g. 'pruning.r_q=0.3 pruning.r_o=0.3'")
    p.add_argument("--device", default="", help="h100 | h200 | a100 | cpu (default: detect)")
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=0.0,
        help="device peak; default: the table, or on a CPU a quick matmul measurement",
    )
    p.add_argument("--nproc", type=int, default=1, help="processes per method (torchrun)")
    p.add_argument("--trace", default="", help="write torch profiler chrome traces of extra steps here")
    p.add_argument("--trace-steps", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1800, help="seconds to wait for one start-up or step")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    p.add_argument("--handshake", default="", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="dotted config overrides for both methods")
    args = p.parse_args(argv)
    return worker(args) if args.worker else coordinate(args)


if __name__ == "__main__":
    sys.exit(main())
