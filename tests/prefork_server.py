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

With --cli the server imports what `python -m megatron_dppo.cli train` imports (vLLM too, ~13 s
of a 2-step tiny run's ~25), in the CLI's order: quiet_libraries first, as the CLI calls it before
torch and vLLM are imported (their log levels are read then). Its requests run a module
("module": "megatron_dppo.cli") as `python -m` would: one plain process (no torchrun variables), or
with nproc > 1 the ranks of a one-node torchrun launch of it (its variables, as a script's ranks);
tests/conftest.py's run_cli sends only non-verbose CLI runs there (logging.verbose=true needs the
libraries' own log levels, which an import fixes).

Protocol (one JSON object per line): the server prints {"ready": pid} once imported, then for each
request {"script" or "module", "args", "nproc", "env", "cwd", "out", "err", "port", "timeout"}
prints {"returncode", "timed_out"}. The server runs no torch op before forking, so no thread pool
exists yet. A child ends as a process would: SystemExit's code, atexit's handlers (a reward pool's
close), flushed output.
"""

import atexit
import json
import os
import runpy
import signal
import sys
import time
import traceback


def _pythonpath(env: dict) -> list[str]:
    return [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]


# Environment variables the server's imports set (vllm_engine's VLLM_ENABLE_V1_MULTIPROCESSING=0,
# quiet_libraries' log levels): a child's environment is the caller's plus these, as the same imports
# in a fresh process would leave it.
_SET_BY_IMPORTS: dict[str, str] = {}

# sys.path without its first entry (the script's dir) and PYTHONPATH's: what every process has
_BASE_PATH = [p for p in sys.path[1:] if p not in _pythonpath(os.environ)]


def _run_rank(req: dict, rank: int) -> int:
    """In the forked child: become rank `rank` of the launch (or, for a one-process module run, the
    one plain process) and run its script or module as __main__."""
    os.environ.clear()
    os.environ.update(req["env"])
    for key, value in _SET_BY_IMPORTS.items():  # what the imports would have set in this process
        os.environ.setdefault(key, value)
    if "script" in req or req["nproc"] > 1:  # a module with nproc > 1: torchrun's ranks of `-m module`
        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(req["nproc"]),
            LOCAL_WORLD_SIZE=str(req["nproc"]),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(req["port"]),
        )
    os.chdir(req.get("cwd") or os.getcwd())
    for fd, path in ((1, req["out"]), (2, req["err"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), fd)
    sys.stdin = open(os.devnull)
    # sys.path as the interpreter would build it: the script's dir (the cwd for -m), PYTHONPATH, the rest
    first = os.getcwd() if "module" in req else os.path.dirname(os.path.abspath(req["script"]))
    sys.path[:] = [first, *_pythonpath(req["env"]), *_BASE_PATH]
    sys.argv = [req.get("script") or req["module"], *req["args"]]
    try:
        if "module" in req:
            sys.modules.pop(req["module"], None)  # as under -m: the module runs once, as __main__
            runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
        else:
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
                atexit._run_exitfuncs()  # what the interpreter's exit would run
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


def _import_cli_stack() -> None:
    """What a `megatron-dppo train` process imports, in its order (cli._train)."""
    from megatron_dppo.run.quiet import quiet_libraries

    quiet_libraries()
    from megatron_dppo.run.collectives import set_launch_env_defaults

    set_launch_env_defaults()
    import megatron_dppo.cli  # noqa: F401
    import megatron_dppo.rollout.vllm_engine  # noqa: F401  (vLLM)
    import megatron_dppo.train.trainer  # noqa: F401


def main() -> None:
    before = dict(os.environ)
    if "--cli" in sys.argv[1:]:
        _import_cli_stack()
    import safetensors.torch  # noqa: F401
    import torch.distributed  # noqa: F401
    from transformers import AutoModelForCausalLM, Qwen3Config  # noqa: F401  (transformers imports lazily)

    import megatron_dppo.megatron  # noqa: F401  (Megatron-Core, without TorchInductor on CPU)

    _SET_BY_IMPORTS.update((k, v) for k, v in os.environ.items() if before.get(k) != v)
    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        print(json.dumps(_launch(json.loads(line))), flush=True)


if __name__ == "__main__":
    main()
