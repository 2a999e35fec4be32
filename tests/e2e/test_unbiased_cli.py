"""megatron-dppo verify-unbiased as a command: its exit codes (0 unbiased, non-zero
for a biased control), plain and with dynamic sampling."""

import subprocess
import sys


def test_cli_exit_codes():
    ok = subprocess.run(
        [sys.executable, "-m", "megatron_dppo.cli", "verify-unbiased", "--draws", "800"], capture_output=True, text=True
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "UNBIASED" in ok.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "megatron_dppo.cli", "verify-unbiased", "--strategy", "cppo", "--draws", "50"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 1 and "BIASED" in bad.stdout
    control = [sys.executable, "-m", "megatron_dppo.cli", "verify-unbiased", "--without-prompt-weight"]
    control += ["--seed", "3", "--r-o", "0", "--draws", "300"]
    bad = subprocess.run(control, capture_output=True, text=True)
    assert bad.returncode == 1 and "WITHOUT w_q (negative control)" in bad.stdout, bad.stdout + bad.stderr


def test_cli_dynamic_sampling_exit_codes():
    """The wiring (the 2500-draw verdicts are tested in process above): completion pruning alone
    is exact (a z-test, few draws suffice); the count rule is caught by its total weight."""
    base = [
        sys.executable,
        "-m",
        "megatron_dppo.cli",
        "verify-unbiased",
        "--dynamic-sampling",
        "-B",
        "8",
        "--draws",
        "300",
    ]
    ok = subprocess.run(base + ["--r-q", "0"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "total weight 8.000 vs 8" in ok.stdout and "exact, decided by the z-test" in ok.stdout
    bad = subprocess.run(base + ["--refill-by", "count"], capture_output=True, text=True)
    assert bad.returncode == 1 and "refill by count" in bad.stdout and "BIASED" in bad.stdout, bad.stdout + bad.stderr
    assert "total weight 8.000" not in bad.stdout


def test_cli_rollout_correction():
    """The wiring of --rollout-correction and --negative-control as a process's exit code (the
    verdicts are tested in process, tests/unit/test_rollout_correction.py): the recommended kind for
    a bf16 rollout passes with every kind's verdict printed; the self-test (rho = 1) exits 1."""
    cmd = [
        sys.executable,
        "-m",
        "megatron_dppo.cli",
        "verify-unbiased",
        "--rollout-correction",
        "tis",
        "--draws",
        "300",
    ]
    ok = subprocess.run(cmd, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "rollout correction: none" in ok.stdout and "BIASED (bounded: " in ok.stdout
    assert "tis          no cap   length 1: relative bias" in ok.stdout and "UNBIASED (exact)" in ok.stdout
    last = ok.stdout.strip().splitlines()[-1]
    assert last.startswith("no line counts against tis: BIASED (bounded: ") and "all unbiased" not in ok.stdout
    bad = subprocess.run(cmd + ["--negative-control", "one"], capture_output=True, text=True)
    assert bad.returncode == 1 and "NEGATIVE CONTROL one" in bad.stdout, bad.stdout + bad.stderr
    assert bad.stdout.strip().splitlines()[-1].startswith("bias detected: ")
