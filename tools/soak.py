#!/usr/bin/env python
"""Soak test: run the trainer for many steps in this process and print its memory against step.

    .venv/bin/python tools/soak.py --steps 1000                       # the tiny addition job
    .venv/bin/python tools/soak.py --steps 300 --tracemalloc          # + where Python memory grows
    .venv/bin/python tools/soak.py --steps 300 --malloc-trim-every 1  # + glibc malloc_trim(0) each step
    .venv/bin/python tools/soak.py --malloc-arena-max 2 ...           # re-runs itself with MALLOC_ARENA_MAX=2
    .venv/bin/python tools/soak.py --steps 300 --by-phase             # + growth per phase of the step
    .venv/bin/python tools/soak.py --steps 300 --no-vllm-onednn       # vLLM linears on torch's GEMM (CPU)

Dotted overrides after the options apply to the config (e.g. pruning.strategy=none). By default
the run evaluates rarely (every 250 steps), saves every 250 steps, logs to TensorBoard but not
wandb, shows no progress bar, and uses trainer.threads=1: a soak on a shared machine.

Every --every steps it prints one row:
    step  rss_mb  py_objects  malloc_used_mb  malloc_free_mb  mmap_mb  [traced_mb]
rss_mb is the process's resident memory; py_objects the objects the garbage collector tracks;
malloc_* come from glibc's mallinfo2(): bytes handed out by malloc, bytes malloc holds free in
its arenas (fragmentation or a high-water mark it has not returned), and bytes in large mmapped
blocks; traced_mb is the Python heap as tracemalloc sees it (with --tracemalloc). RSS growing with
malloc_used flat points at the allocator; malloc_used growing with py_objects flat at native code
(torch, vLLM caches); py_objects growing at Python containers (tracemalloc then names the line).

With --tracemalloc, tracing starts after the warm-up (tracing has its own cost) and the biggest
growth sites between two late snapshots (at 50% and 100% of the post-warm-up steps) are printed.
The summary prints the RSS growth from the end of the warm-up to the last step (target: <= 5%
over 1000 steps) and the least-squares slope in MB per 100 steps over the post-warm-up rows.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SOAK_DEFAULTS = [
    "trainer.eval_every=250",
    "trainer.save_every=250",
    "trainer.max_time_s=0",
    "logging.wandb=disabled",
    "logging.progress=false",
    "trainer.threads=1",
]


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _libc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        return libc
    except (OSError, AttributeError):  # not glibc >= 2.33: no malloc columns
        return None


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class PhaseGrowth:
    """Where native memory grows: the change of malloc's in-use bytes and of RSS across each call
    of the wrapped trainer parts (rollout, reward, train, sync), summed over the post-warm-up steps."""

    def __init__(self, libc):
        self.libc, self.active = libc, False
        self.totals: dict[str, list[float]] = {}  # phase -> [malloc_used delta MB, rss delta MB, calls]

    def wrap(self, obj, attr: str, phase: str) -> None:
        fn = getattr(obj, attr)

        def measured(*a, **k):
            if not self.active or self.libc is None:
                return fn(*a, **k)
            used0, rss0 = self.libc.mallinfo2().uordblks, rss_mb()
            try:
                return fn(*a, **k)
            finally:
                t = self.totals.setdefault(phase, [0.0, 0.0, 0])
                t[0] += (self.libc.mallinfo2().uordblks - used0) / 2**20
                t[1] += rss_mb() - rss0
                t[2] += 1

        setattr(obj, attr, measured)

    def report(self) -> str:
        if not self.totals:
            return ""
        lines = [
            "growth by phase after the warm-up (sum over calls of the change across each call):",
            f"  {'phase':<10} {'calls':>6} {'malloc_used_mb':>15} {'rss_mb':>10}",
        ]
        for phase, (used, rss, calls) in self.totals.items():
            lines.append(f"  {phase:<10} {calls:>6} {used:>+15.1f} {rss:>+10.1f}")
        return "\n".join(lines)


class MemoryLog:
    """The rows printed against step, and the two tracemalloc snapshots."""

    def __init__(self, every: int, warmup: int, steps: int, trace: bool, trim_every: int):
        self.every, self.warmup, self.steps, self.trace, self.trim_every = every, warmup, steps, trace, trim_every
        self.rows: list[dict] = []
        self.snapshots: list[tuple[int, tracemalloc.Snapshot]] = []
        self.libc = _libc()
        self.mid = warmup + (steps - warmup) // 2
        self.phases: PhaseGrowth | None = None
        self.trim_s = 0.0  # time spent in malloc_trim

    def after_step(self, step: int) -> None:
        if self.phases is not None and step == self.warmup:
            self.phases.active = True
        if self.trim_every and self.libc is not None and step % self.trim_every == 0:
            t0 = time.perf_counter()
            self.libc.malloc_trim(0)
            self.trim_s += time.perf_counter() - t0
        if self.trace and step == self.warmup:
            tracemalloc.start(8)
        if self.trace and step in (self.mid, self.steps) and tracemalloc.is_tracing():
            gc.collect()
            self.snapshots.append((step, tracemalloc.take_snapshot()))
        if step % self.every and step not in (1, self.warmup, self.steps):
            return
        row = {"step": step, "rss_mb": rss_mb(), "py_objects": len(gc.get_objects())}
        if self.libc is not None:
            mi = self.libc.mallinfo2()
            row.update(
                malloc_used_mb=mi.uordblks / 2**20, malloc_free_mb=mi.fordblks / 2**20, mmap_mb=mi.hblkhd / 2**20
            )
        if tracemalloc.is_tracing():
            row["traced_mb"] = tracemalloc.get_traced_memory()[0] / 2**20
        self.rows.append(row)
        print("  ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)

    def table(self) -> str:
        cols = [
            c
            for c in ("step", "rss_mb", "py_objects", "malloc_used_mb", "malloc_free_mb", "mmap_mb", "traced_mb")
            if any(c in r for r in self.rows)
        ]
        lines = [" ".join(f"{c:>14}" for c in cols)]
        for r in self.rows:
            lines.append(
                " ".join(f"{r[c]:>14.1f}" if isinstance(r.get(c), float) else f"{r.get(c, ''):>14}" for c in cols)
            )
        return "\n".join(lines)

    def summary(self) -> str:
        late = [r for r in self.rows if r["step"] >= self.warmup]
        if len(late) < 2:
            return f"too few rows after the warm-up of {self.warmup} steps for a growth figure"
        first, last = late[0], late[-1]
        growth = (last["rss_mb"] - first["rss_mb"]) / first["rss_mb"]
        xs, ys = [r["step"] for r in late], [r["rss_mb"] for r in late]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(sum((x - mx) ** 2 for x in xs), 1e-9)
        return (
            f"RSS {first['rss_mb']:.1f} MB at step {first['step']} (end of warm-up) -> {last['rss_mb']:.1f} MB "
            f"at step {last['step']}: {growth:+.1%} over {last['step'] - first['step']} steps; slope "
            f"{slope * 100:+.2f} MB per 100 steps (target: <= +5% over 1000 steps)"
        )

    def growth_sites(self, top: int = 15) -> str:
        if len(self.snapshots) < 2:
            return ""
        (s0, a), (s1, b) = self.snapshots[0], self.snapshots[-1]
        filters = [tracemalloc.Filter(False, tracemalloc.__file__)]
        stats = b.filter_traces(filters).compare_to(a.filter_traces(filters), "traceback")
        lines = [f"tracemalloc: biggest growth from step {s0} to step {s1} (size change, count change, where)"]
        for st in sorted(stats, key=lambda s: s.size_diff, reverse=True)[:top]:
            frames = [f"{fr.filename.replace(str(REPO) + '/', '')}:{fr.lineno}" for fr in st.traceback][-4:]
            lines.append(f"  {st.size_diff / 1024:+9.1f} KiB {st.count_diff:+7d}  " + " <- ".join(reversed(frames)))
        return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(REPO / "examples" / "tiny" / "addition.yaml"))
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--every", type=int, default=50, help="print a row every N steps")
    ap.add_argument("--warmup", type=int, default=100, help="steps before the growth is measured")
    ap.add_argument("--tracemalloc", action="store_true")
    ap.add_argument("--malloc-trim-every", type=int, default=0)
    ap.add_argument(
        "--by-phase", action="store_true", help="attribute malloc/RSS growth to rollout, reward, train, sync"
    )
    ap.add_argument(
        "--no-vllm-onednn",
        action="store_true",
        help="CPU: vLLM's linear layers use torch's GEMM instead of oneDNN handlers (whose per-shape "
        "primitive caches grow with every new batch size)",
    )
    ap.add_argument("--malloc-arena-max", type=int, default=0, help="re-run with MALLOC_ARENA_MAX set")
    ap.add_argument("--out", default="", help="run dir parent (default: a temporary dir)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if args.warmup >= args.steps:
        ap.error(f"--warmup ({args.warmup}) must be below --steps ({args.steps})")
    if args.malloc_arena_max and os.environ.get("MALLOC_ARENA_MAX") != str(args.malloc_arena_max):
        # glibc reads it at start-up only: run this script again with it set.
        env = dict(os.environ, MALLOC_ARENA_MAX=str(args.malloc_arena_max))
        os.execve(sys.executable, [sys.executable, *sys.argv], env)

    from megatron_dppo.config import load_config, validate
    from megatron_dppo.run.quiet import quiet_libraries

    out = args.out or tempfile.mkdtemp(prefix="soak-")
    overrides = (
        SOAK_DEFAULTS
        + [f"trainer.max_steps={args.steps}", f"trainer.output_dir={out}", "trainer.run_name=soak"]
        + args.overrides
    )
    cfg = load_config(args.config, overrides)
    quiet_libraries(verbose=cfg.logging.verbose)
    validate(cfg)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.no_vllm_onednn:
        import vllm._custom_ops

        vllm._custom_ops._supports_onednn = False  # read when the engine's model is loaded
    from megatron_dppo.train.trainer import Trainer

    log = MemoryLog(args.every, args.warmup, args.steps, args.tracemalloc, args.malloc_trim_every)
    print(
        f"soak: {args.steps} steps of {args.config} {' '.join(args.overrides)} in {out}; "
        f"MALLOC_ARENA_MAX={os.environ.get('MALLOC_ARENA_MAX', 'unset')}, malloc_trim every "
        f"{args.malloc_trim_every or 'never'}, tracemalloc {'on' if args.tracemalloc else 'off'}, vLLM oneDNN GEMM "
        f"{'off' if args.no_vllm_onednn else 'on'}",
        flush=True,
    )
    t0 = time.perf_counter()
    trainer = Trainer(cfg)
    print(f"trainer started in {time.perf_counter() - t0:.1f}s, RSS {rss_mb():.1f} MB", flush=True)
    step_fn = trainer.step

    def measured_step(step: int) -> dict:  # the real loop (logging, eval, saves) calls this
        metrics = step_fn(step)
        log.after_step(step)
        return metrics

    trainer.step = measured_step
    if args.by_phase:
        log.phases = PhaseGrowth(log.libc)
        for obj, attr, phase in (
            (trainer.engine, "generate", "rollout"),
            (trainer.scorer, "score", "reward"),
            (trainer.policy, "train_step", "train"),
            (trainer, "_sync_weights", "sync"),
        ):
            log.phases.wrap(obj, attr, phase)
    t0 = time.perf_counter()
    try:
        trainer.train()
    finally:
        trainer.close()
    print(f"\n{args.steps} steps in {time.perf_counter() - t0:.0f}s\n{log.table()}\n{log.summary()}")
    if args.malloc_trim_every:
        print(
            f"malloc_trim(0) every {args.malloc_trim_every} steps took {log.trim_s:.2f}s in total "
            f"({log.trim_s / (args.steps // args.malloc_trim_every) * 1000:.1f} ms a call)"
        )
    for extra in (log.phases.report() if log.phases else "", log.growth_sites()):
        if extra:
            print(extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
