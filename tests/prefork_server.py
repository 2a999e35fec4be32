"""Forks the ranks of a test's worker launch from a process that has already imported torch,
Megatron-Core and transformers (tests/conftest.py's run_workers, fork=True).

Why: a torchrun launch of a compute check costs the launcher's start plus every rank's imports,
~5 s of CPU each on this machine, far more than most checks compute; the distributed tests make
~100 such launches. Forked ranks share the imports made once here. Each rank gets what torchrun
gives it (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), the caller's
environment, its script as __main__ with the caller's arguments, and the launch's output files; the
launch ends, as under torchrun, when every rank has exited or one has failed (the others are then
stopped). What torchrun itself does (its agent, restarts, its failure report, signals to a stalled
rank) is tested through real torchrun launches, which the fault tests keep.

Protocol (one JSON object per line): the server prints {"ready": pid} once imported, then for each
request {"script", "args", "nproc", "env", "out", "err", "port", "timeout"} prints {"returncode",
"timed_out"}. The server runs no torch op before forking, so no thread pool exists yet.
"""

import json
import os
import runpy
import signal
import sys
import time
import traceback


def _run_rank(req: dict, rank: int) -> int:
    """In the forked child: become rank `rank` of the launch and run its script as __main__."""
    os.environ.clear()
    os.environ.update(req["env"])
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(req["nproc"]),
        LOCAL_WORLD_SIZE=str(req["nproc"]),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(req["port"]),
    )
    for fd, path in ((1, req["out"]), (2, req["err"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), fd)
    sys.stdin = open(os.devnull)
    sys.argv = [req["script"], *req["args"]]
    sys.path[0] = os.path.dirname(os.path.abspath(req["script"]))
    try:
        runpy.run_path(req["script"], run_name="__main__")
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1


def _launch(req: dict) -> dict:
    pids = []
    for rank in range(req["nproc"]):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.setpgid(0, pids[0] if pids else 0)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                code = _run_rank(req, rank)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        try:
            os.setpgid(pid, pids[0] if pids else pid)  # also here: no race with the child's own call
        except OSError:
            pass
        pids.append(pid)
    return _wait(pids, req["timeout"])


def _wait(pids: list[int], timeout: float) -> dict:
    """Until every rank exited (0), one failed (its status; the others are stopped), or timeout."""
    codes: dict[int, int] = {}
    deadline = time.monotonic() + timeout
    failed = None
    while len(codes) < len(pids):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if time.monotonic() > deadline:
                break
            time.sleep(0.02)
            continue
        codes[pid] = os.waitstatus_to_exitcode(status)
        if codes[pid] != 0 and failed is None:
            failed = codes[pid]
            break
    timed_out = len(codes) < len(pids) and failed is None
    if len(codes) < len(pids):
        try:
            os.killpg(pids[0], signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in pids:
            if pid not in codes:
                codes[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    returncode = failed if failed is not None else (-signal.SIGKILL if timed_out else 0)
    return {"returncode": returncode, "timed_out": timed_out}


def main() -> None:
    import safetensors.torch  # noqa: F401
    import torch.distributed  # noqa: F401
    from transformers import AutoModelForCausalLM, Qwen3Config  # noqa: F401  (transformers imports lazily)

    import megatron_dppo.megatron  # noqa: F401  (Megatron-Core, without TorchInductor on CPU)

    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        print(json.dumps(_launch(json.loads(line))), flush=True)


if __name__ == "__main__":
    main()
