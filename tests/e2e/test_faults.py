"""Faults: a trainer killed with SIGKILL leaves no process behind (checkpoint writers, the reward
pool and its forkserver, multiprocessing's resource tracker). Real processes, real kills."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(REPO, "tests", "dist", "workers", "step", "ckpt_check.py")


def session_processes(sid: int) -> list[str]:
    """Live (non-zombie) processes of session `sid` other than its leader: everything a process
    started with start_new_session=True forked or spawned, wherever it was reparented to."""
    found = []
    for p in psutil.process_iter(["pid", "status", "cmdline"]):
        try:
            if p.info["pid"] != sid and os.getsid(p.info["pid"]) == sid and p.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(f"{p.info['pid']}: {' '.join(p.info['cmdline'] or [])[:160]}")
        except (ProcessLookupError, PermissionError, psutil.Error):
            pass
    return found


def _wait_for(cond, timeout: float, every: float = 0.2):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = cond()
        if value:
            return value
        time.sleep(every)
    return cond()


def test_sigkill_during_checkpoint_save_leaves_no_process_behind(tmp_path):
    """The worker starts a reward pool with a check hung in it, then saves a checkpoint whose
    shard writer blocks (a disk that stops answering); SIGKILL it there. Megatron's own writer
    would be a forked child here (plus a Manager server process), both outliving the kill."""
    marker = tmp_path / "writer_pids"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    with open(tmp_path / "out.txt", "w+") as out:
        proc = subprocess.Popen(
            [sys.executable, WORKER, "--phase", "hold-save", "--ckpt", str(tmp_path / "ckpt"), "--out", str(marker)],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        try:
            started = _wait_for(lambda: marker.exists() or proc.poll() is not None, timeout=300)
            if proc.poll() is not None or not started:
                out.seek(0)
                pytest.fail(f"the worker never reached the shard write (exit {proc.poll()}):\n{out.read()[-5000:]}")
            time.sleep(0.5)
            before = session_processes(proc.pid)
            writer_pids = {int(x) for x in marker.read_text().split()}
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            survivors = _wait_for(lambda: not session_processes(proc.pid), timeout=30) or session_processes(proc.pid)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # whatever the assertions say, leave nothing running
            except ProcessLookupError:
                pass
    # The shards were being written by the saving process itself, not by a child of it.
    assert writer_pids == {proc.pid}, (writer_pids, proc.pid, before)
    # The pool was really there to kill: the forkserver and its two workers (one hung; forked
    # from the server, they show its command line), and the resource tracker.
    assert sum("forkserver" in p for p in before) == 3 and sum("resource_tracker" in p for p in before) == 1, before
    assert survivors is True, f"still alive 30 s after SIGKILL of the trainer: {survivors}"


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one-process", "xdist"])
def test_session_end_check_reports_and_kills_processes_that_outlive_the_tests(tmp_path, workers):
    """The harness itself (tests/conftest.py): a test that leaves a process running fails the run,
    and the process is killed; so does a worker launch (run_workers) whose child outlives it; a
    RewardScorer closed properly leaves nothing. In one process and on pytest-xdist's workers
    (what `make test` runs), where the worker's findings reach the controller."""
    (tmp_path / "leaky_launch.py").write_text(
        "import subprocess, sys\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(601)'], start_new_session=True)\n"
    )
    (tmp_path / "test_leaky.py").write_text(
        "import subprocess, sys\n"
        "from conftest import run_workers\n"
        "from megatron_dppo.rewards import RewardScorer\n"
        "def test_clean():\n"
        "    with RewardScorer('exact', num_workers=1) as s:\n"
        "        assert s.score(['1'], ['1'])[0] == [1.0]\n"
        "def test_leaks():\n"
        "    subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True)\n"
        "def test_launch_leaks():\n"
        f"    assert run_workers({str(tmp_path / 'leaky_launch.py')!r}, 1).returncode == 0\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_DPPO_TEST_")}
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(REPO, "tests"), REPO])
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "conftest",
            "-p",
            "no:cacheprovider",
            *workers,
            str(tmp_path / "test_leaky.py"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = res.stdout + res.stderr
    assert res.returncode == 1 and "3 passed" in out, out[-3000:]
    assert "2 process(es) started by the tests outlived them (now killed)" in out, out[-3000:]
    assert "time.sleep(600)" in out and "time.sleep(601)" in out, out[-3000:]
    for line in out.split("outlived them (now killed):")[1].splitlines()[1:3]:
        pid = int(line.split()[0])
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, line


def test_soak_tool_growth_figures_match_an_independent_fit():
    """tools/soak.py's summary (RSS growth after warm-up, least-squares slope) against numpy."""
    import numpy as np

    sys.path.insert(0, os.path.join(REPO, "tools"))
    from soak import MemoryLog

    log = MemoryLog(every=50, warmup=100, steps=1000, trace=False, trim_every=0)
    rng = np.random.default_rng(0)
    steps = [1, 50] + list(range(100, 1001, 50))
    rss = [700.0, 760.0] + [800 + 0.02 * (s - 100) + float(rng.normal(0, 2)) for s in steps[2:]]
    log.rows = [{"step": s, "rss_mb": r, "py_objects": 1} for s, r in zip(steps, rss)]
    summary = log.summary()
    growth = (rss[-1] - rss[2]) / rss[2]
    slope = np.polyfit(steps[2:], rss[2:], 1)[0]
    assert f"{growth:+.1%} over 900 steps" in summary and f"slope {slope * 100:+.2f} MB per 100 steps" in summary, (
        summary
    )
    assert "step" in log.table().splitlines()[0] and len(log.table().splitlines()) == len(steps) + 1


# ---- issue 24: inputs that deleted data, or failed silently or unclearly -------------------------------
def _cli(*args, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "megatron_dppo.cli", *map(str, args)]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def _files(root) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("run_name", ["..", ""])
def test_overwrite_with_a_run_name_that_is_not_one_dir_deletes_nothing(tmp_path, run_name):
    """`trainer.run_name=.. --overwrite` deleted the PARENT of trainer.output_dir (another project's
    files in it); an empty run_name wiped the whole output dir, other runs included."""
    out = tmp_path / "outer" / "runs"
    (out / "earlier-run").mkdir(parents=True)
    (out / "earlier-run" / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "outer" / "other-project.txt").write_text("not ours")
    before = _files(tmp_path)
    res = _cli(
        "train", "--config", "examples/tiny/addition.yaml", "--overwrite",
        f"trainer.output_dir={out}", f"trainer.run_name={run_name}",
    )  # fmt: skip
    assert res.returncode == 1, res.stderr[-3000:]
    assert res.stderr.strip().splitlines() == [
        f"error: config key 'trainer.run_name': expected one plain directory name (no '/', not . or ..), got "
        f"{run_name!r}  (ValueError; --debug shows the traceback)"
    ], res.stderr[-3000:]
    assert _files(tmp_path) == before


@pytest.mark.parametrize(
    "arg, message",
    [("--draws", "expected an integer >= 2, got 0"), ("--num-prompts", "expected an integer >= 2, got 0")],
)
def test_verify_unbiased_refuses_zero_draws_or_prompts_in_one_line(arg, message):
    """Were tensor errors ("stack expects a non-empty TensorList", "index 0 is out of bounds")."""
    res = _cli("verify-unbiased", arg, "0")
    assert res.returncode == 2, res.stderr[-2000:]
    name = "--num-prompts/-B" if arg == "--num-prompts" else arg
    assert res.stderr.strip().splitlines()[-1] == f"megatron-dppo verify-unbiased: error: argument {name}: {message}"
    assert "Traceback" not in res.stderr


def test_a_tiny_kv_cache_names_rollout_kv_cache_gb():
    """vLLM's own error advises raising gpu_memory_utilization, which does nothing here: the CPU KV
    cache is rollout.kv_cache_gb (the trainer passes it as kv_cache_memory_bytes)."""
    import torch

    from megatron_dppo.rollout import RolloutEngine

    set_num_threads = torch.set_num_threads
    with pytest.raises(ValueError) as e:
        RolloutEngine("examples/tiny/model", dtype="float32", max_model_len=32, kv_cache_memory_bytes=200_000)
    # vLLM's CPU worker swaps torch.set_num_threads for a no-op; a failed start must put it back too
    assert torch.set_num_threads is set_num_threads
    # and not leave the world vLLM made for itself (the next init_process_group in this process failed)
    assert not torch.distributed.is_initialized()
    assert str(e.value) == (
        "rollout.kv_cache_gb=0.0001863 (200000 bytes) leaves vLLM's KV cache too small for one sequence of "
        "rollout.max_model_len=32 tokens (1536 bytes a token for this model; vLLM allocates whole blocks of tokens, "
        "one kept in reserve): raise rollout.kv_cache_gb or lower rollout.max_model_len"
    )
    # 1536 = K and V x 3 layers x 2 KV heads x head_dim 32 x 4 bytes (float32): examples/tiny/model/config.json.
