"""Training runs of the e2e tests (`megatron-dppo train`, a torchrun command line for several
processes: `run` forks its ranks from the test's prefork server, start_logged starts real
torchrun for the tests that signal it): the small step budgets, the command, and how two runs are
compared (rollouts token for token, metrics and final weights within 1e-5 relative)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
from conftest import run_cli, run_workers
from safetensors.torch import load_file

from megatron_dppo.run.process import free_port

# One-process runs (tests/e2e/test_trainer.py, test_trainer_faults.py).
SMALL = [
    "trainer.prompts_per_step=8",
    "rollout.group_size=4",
    "data.train_size=16",
    "trainer.eval_every=0",
    "logging.wandb=disabled",
    "logging.progress=false",
    "logging.tensorboard=false",
    "trainer.threads=1",
    "trainer.max_time_s=0",
]  # step budgets, not wall-clock ones: a loaded machine must not cut runs short

# Multi-process runs against one process (tests/e2e/test_trainer_dist.py, test_trainer_moe.py).
REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "examples" / "tiny"
STEPS = 2
DIST_SMALL = [
    "trainer.prompts_per_step=8",
    "rollout.group_size=4",
    "data.train_size=8",
    "trainer.eval_every=0",
    "logging.wandb=disabled",
    "logging.progress=false",
    "logging.tensorboard=false",
    "trainer.threads=1",
    "trainer.max_time_s=0",
    "logging.rollouts=true",
    f"trainer.max_steps={STEPS}",
    "pruning.r_q=0.5",
    "pruning.r_o=0.5",
    "optim.lr=1e-4",
]


def small_train_cmd(out, name, *overrides, resume=False):
    """A one-process run of the tiny main job at the SMALL budget (`python -m megatron_dppo.cli train`)."""
    cmd = [sys.executable, "-m", "megatron_dppo.cli", "train", "--config", str(TINY / "addition.yaml"),
           f"trainer.output_dir={out}", f"trainer.run_name={name}", *SMALL, *overrides]  # fmt: skip
    return cmd + (["--resume"] if resume else [])


def run_env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


def train_cmd(out, name, model_dir, nproc, *overrides, resume=False):
    launcher = (
        [sys.executable]
        if nproc == 1
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            "--master_addr=127.0.0.1",
            f"--master_port={free_port()}",
        ]
    )
    cmd = launcher + [
        "-m",
        "megatron_dppo.cli",
        "train",
        "--config",
        str(TINY / "addition.yaml"),
        f"model.hf_dir={model_dir}",
        f"trainer.output_dir={out}",
        f"trainer.run_name={name}",
        *DIST_SMALL,
        *overrides,
    ]
    return cmd + (["--resume"] if resume else [])


def run(cmd, timeout=600):
    res = run_cli(cmd, run_env(), timeout)  # one-process CLI runs fork from a server with the imports done
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    return res


def start_logged(cmd, log: Path) -> subprocess.Popen:
    """A run in the background, in its own session (signals reach only it), its screen in `log`."""
    return subprocess.Popen(
        cmd, cwd=REPO, env=run_env(), start_new_session=True, stdout=log.open("w"), stderr=subprocess.STDOUT
    )


def wait_for_first_row(run_dir: Path, proc: subprocess.Popen, timeout: float = 400) -> None:
    """Until the run logs its first step (or exits, or the timeout passes)."""
    path = run_dir / "metrics.jsonl"
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None and not (path.exists() and path.read_text().strip()):
        time.sleep(0.05)


def kill_launcher_alone(proc: subprocess.Popen, ranks: list, timeout: float = 180) -> list:
    """SIGKILL to torchrun only (an OOM kill, a lost node agent); -> the ranks still alive after
    `timeout` s, which are then killed so that the test leaves nothing behind."""
    proc.kill()
    proc.wait()
    _, alive = psutil.wait_procs(ranks, timeout=timeout)
    for p in alive:
        p.kill()
    return alive


def metrics(run_dir) -> dict:
    with open(run_dir / "metrics.jsonl") as f:
        return {r["step"]: r for r in map(json.loads, f)}


def rollouts(run_dir, step) -> list:
    with open(run_dir / "rollouts" / f"step_{step:06d}.jsonl") as f:
        return [json.loads(line) for line in f]


def assert_same_rollouts(got: list, ref: list) -> None:
    """Rows equal token for token, rewards and weights too; the engine's log-prob sums (float
    roundoff of engines with other batch compositions or TP degrees) within 1e-4."""
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        g, r = dict(g), dict(r)
        lp_g, lp_r = g.pop("rollout_logprob_sum", None), r.pop("rollout_logprob_sum", None)
        assert g == r
        assert (lp_g is None) == (lp_r is None) and (lp_g is None or abs(lp_g - lp_r) <= 1e-4 * max(1.0, abs(lp_r)))


_CONVERTED = {}


def final_weights(run_dir, tmp) -> dict:
    """The run's last checkpoint as HF tensors (the converter reads any TP/PP layout). The converter
    runs forked from the prefork server (conftest's run_workers, fork=True), whose imports are done:
    in a fresh interpreter a conversion took 14.5 s with both cores busy, 0.2 s of it converting;
    forked, 0.7 s (the same tensors, bit for bit). test_trainer_dist alone converts 8 runs. The
    converter's own command line is tested in tests/dist/test_convert_tools.py."""
    if run_dir in _CONVERTED:
        return _CONVERTED[run_dir]
    out = tmp / f"hf-{run_dir.name}"
    args = ("--megatron-dir", run_dir / "checkpoints", "--out-dir", out)
    res = run_workers(REPO / "tools" / "convert_megatron_to_hf.py", 1, *args, timeout=300, fork=True)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    _CONVERTED[run_dir] = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    return _CONVERTED[run_dir]


def rel_close(a: float, b: float, rel=1e-5, floor=1e-6) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b)) + floor


def assert_same_run(ref_dir, run_dir, tmp, steps=range(1, STEPS + 1)):
    assert_same_rollouts(rollouts(run_dir, 1), rollouts(ref_dir, 1))
    ref, got = metrics(ref_dir), metrics(run_dir)
    for s in steps:
        for key in ("train/loss", "train/grad_norm", "reward/mean", "prune/prompts_kept_frac", "tokens/trained"):
            assert rel_close(got[s][key], ref[s][key]), (s, key, got[s][key], ref[s][key])
    w_ref, w_got = final_weights(ref_dir, tmp), final_weights(run_dir, tmp)
    start = load_file(ref_dir.parent / "model" / "model.safetensors")
    assert w_ref.keys() == w_got.keys() == start.keys()
    # The whole model within 1e-5 relative. Per tensor, the UPDATE (end - start) agrees within 0.1%:
    # elementwise maxima are not used because Adam turns roundoff-level gradients (|g| << eps) of
    # a different summation order into visible but meaningless differences.
    diff2 = sum(float((w_got[k] - w_ref[k]).double().pow(2).sum()) for k in w_ref)
    norm2 = sum(float(w_ref[k].double().pow(2).sum()) for k in w_ref)
    assert (diff2 / norm2) ** 0.5 < 1e-5, (diff2 / norm2) ** 0.5
    for name in w_ref:
        update = (w_ref[name] - start[name]).norm()
        assert update > 0, f"{name} did not train"
        assert (w_got[name] - w_ref[name]).norm() / update < 1e-3, name
