import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(script, nproc: int, *args, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run a worker script (under torchrun on a free port when nproc > 1) in its own process
    group. Output goes to files, not pipes, and the whole group is killed afterwards: a worker
    that dies by SIGKILL can leave children (dist_checkpointing's multiprocessing manager)
    holding inherited pipes open forever."""
    if nproc == 1:
        cmd = [sys.executable, str(script), *map(str, args)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               "--master_addr=127.0.0.1", f"--master_port={_free_port()}", str(script), *map(str, args)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=err, env=env, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(cmd, proc.returncode, out.read(), err.read())


def run_torchrun(script, nproc: int, *args, timeout: float = 300) -> str:
    """Like run_workers, but return the combined output, or fail the test showing it."""
    proc = run_workers(script, nproc, *args, timeout=timeout)
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(proc.args[2:])} exited with {proc.returncode}:\n{output[-20000:]}",
                    pytrace=False)
    return output


@pytest.fixture
def torchrun():
    """torchrun(script, nproc, *args) -> combined output; fails the test on a non-zero exit."""
    return run_torchrun


@pytest.fixture
def launch():
    """launch(script, nproc, *args) -> CompletedProcess, whatever the exit status."""
    return run_workers
