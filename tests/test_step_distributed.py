"""DPPO inside Megatron's distributed step: the gradient does not depend on the layout.

Each case launches tests/dist_step/grad_check.py (2 processes under torchrun over gloo, or 1):
every rank compares the Megatron gradient of the DPPO loss with a single-process reference on
the HF model (plain PyTorch), for every loss aggregation, GSPO, KL, pruning weights on and off,
and 1 vs several micro-batches per rank.
"""
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
WORKER = HERE / "dist_step" / "grad_check.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(script, nproc, *args, timeout=600):
    if nproc == 1:
        cmd = [sys.executable, str(script), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_port", str(_free_port()), str(script), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.parametrize("nproc,tp,pp", [(1, 1, 1), (2, 1, 1), (2, 2, 1), (2, 1, 2)],
                         ids=["single", "dp2", "tp2", "pp2"])
def test_megatron_gradient_equals_single_process_reference(nproc, tp, pp):
    res = run_workers(WORKER, nproc, "--tp", str(tp), "--pp", str(pp))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    assert "GRAD CHECK PASSED" in res.stdout
    # 4 loss settings x 2 pruning settings x 2 micro-batch splits, all compared
    assert res.stdout.count("\nok ") + res.stdout.startswith("ok ") == 16


def test_check_detects_per_token_normalisation():
    """Negative control: Megatron's default 1/num_tokens gradient scaling must be caught."""
    res = run_workers(WORKER, 2, "--negative-control")
    assert res.returncode != 0
    assert "relative grad error" in res.stdout + res.stderr
