"""The 32B example's launch scripts, run as a user runs them.

- launch_torchrun.sh as two "nodes" on 127.0.0.1 (c10d rendezvous, one CPU process each) with
  the tiny model and data given through the script's environment variables: both exit 0 and
  rank 0 alone writes metrics.jsonl.
- slurm.sbatch's dry run prints every node's torchrun command; the submission path (srun
  replaced by a stand-in that runs its command once per node) produces the same commands.
"""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dppo.config import check_layout, load_config
from megatron_dppo.jobs.plan import load_hf_config
from megatron_dppo.model.arch import Arch
from megatron_dppo.run.process import free_port

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "qwen3_32b"
TINY_MODEL = REPO / "examples" / "tiny" / "model"
TINY_DATA = REPO / "examples" / "tiny" / "data" / "train.jsonl"
TINY_CONFIG = REPO / "examples" / "tiny" / "addition.yaml"

# Small enough for CI on 2 cores: 4 prompts x 4 completions a step, 2 steps, no evaluation.
TINY_RUN = [
    "trainer.max_steps=2",
    "trainer.prompts_per_step=4",
    "rollout.group_size=4",
    "trainer.eval_every=0",
    "trainer.max_time_s=0",
    "trainer.threads=1",
    "reward.num_workers=1",
    "logging.wandb=disabled",
    "logging.tensorboard=false",
    "logging.progress=false",
]


def _clean_env(**extra) -> dict:
    """This environment without anything a launcher sets (a test run under torchrun or SLURM
    must not leak its own rank or allocation into the scripts)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "TORCHELASTIC_"))
        and k
        not in (
            "RANK",
            "LOCAL_RANK",
            "WORLD_SIZE",
            "LOCAL_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
            "NODE_RANK",
            "NNODES",
            "GPUS_PER_NODE",
            "RDZV_ID",
            "DRY_RUN",
            "SKIP_PLAN",
            "CONFIG",
        )
    }
    env.update({"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHON": sys.executable, **extra})
    return env


def _tail(path: Path, n: int = 6000) -> str:
    return path.read_text(errors="replace")[-n:]


@pytest.mark.slow
def test_two_nodes_on_one_host(tmp_path):
    """NNODES=2 x GPUS_PER_NODE=1 on 127.0.0.1: each node a torchrun agent with one trainer process
    (its own vLLM engine, DP=2), meeting at a c10d rendezvous on a free port."""
    out_dir = tmp_path / "runs"
    env = _clean_env(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        NNODES="2",
        GPUS_PER_NODE="1",
        HF_DIR=str(TINY_MODEL),
        TRAIN_DATA=str(TINY_DATA),
        CONFIG=str(TINY_CONFIG),
    )
    args = [*TINY_RUN, f"trainer.output_dir={out_dir}", "trainer.run_name=two-nodes"]
    procs, logs = [], []
    try:
        for node in (0, 1):
            log = tmp_path / f"node{node}.log"
            with open(log, "w") as f:  # files, not pipes: nothing blocks on a full pipe
                procs.append(
                    subprocess.Popen(
                        ["bash", str(EXAMPLE / "launch_torchrun.sh"), *args],
                        env=dict(env, NODE_RANK=str(node)),
                        cwd=tmp_path,
                        stdout=f,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
            logs.append(log)
        codes = [p.wait(timeout=540) for p in procs]
    finally:
        for p in procs:  # the agents, their trainers and any reward workers
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
    report = "\n".join(
        f"--- node {k} (exit {p.returncode}) ---\n{_tail(log)}" for k, (p, log) in enumerate(zip(procs, logs))
    )
    assert codes == [0, 0], report
    for log in logs:  # the script's `plan` pre-check ran on each node and accepted the layout
        text = log.read_text(errors="replace")
        assert "TP 1 x PP 1 x DP 2" in text and "FITS" in text, report
    metrics = out_dir / "two-nodes" / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    # Rank 0 alone writes; two processes that each made a 1-rank world would both be rank 0
    # and append every step twice.
    assert [r["step"] for r in rows] == [1, 2], report
    assert all(r["train/optimizer_steps"] >= 0 and "reward/mean" in r for r in rows)


def _fake_tools(tmp_path, nodes: list[str]) -> Path:
    """scontrol that expands the node list as SLURM would; python and srun that only record
    that they were called (the dry run must run neither)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    hosts = "\\n".join(nodes)
    tools = {
        "scontrol": f'#!/bin/sh\n[ "$1 $2" = "show hostnames" ] || exit 1\nprintf "{hosts}\\n"\n',
        "python-not-to-run": f'#!/bin/sh\necho "$0 $*" >> {tmp_path}/ran\nexit 1\n',
        "srun": f'#!/bin/sh\necho "srun $*" >> {tmp_path}/ran\nexit 1\n',
    }
    for name, text in tools.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def _slurm_env(tmp_path, bin_dir, **extra) -> dict:
    return _clean_env(
        **{
            "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "SLURM_NNODES": "3",
            "SLURM_JOB_NODELIST": "gpu[07-09]",
            "SLURM_JOB_ID": "4242",
            "SLURM_GPUS_ON_NODE": "8",
            "SLURM_SUBMIT_DIR": str(REPO),
            "HF_DIR": "/models/Qwen3-32B",
            "TRAIN_DATA": "/data/math.jsonl",
            **extra,
        }
    )


def _node_commands(stdout: str) -> dict[int, list[str]]:
    """'node K: env VAR=... python -m torch.distributed.run ...' lines -> {K: argv after env}."""
    commands = {}
    for line in stdout.splitlines():
        m = re.match(r"node (\d+): (.*)", line)
        if m:
            argv = shlex.split(m.group(2))
            assert argv[0] == "env", line
            commands[int(m.group(1))] = argv[1:]
    return commands


def _split(argv: list[str]):
    """argv after `env` -> (environment, torchrun flags, config path, overrides)."""
    n_env = next(i for i, a in enumerate(argv) if "=" not in a)
    env = dict(a.split("=", 1) for a in argv[:n_env])
    python, dash_m, module, *rest = argv[n_env:]
    assert (dash_m, module) == ("-m", "torch.distributed.run")
    cut = rest.index("-m")
    flags = dict(zip(rest[:cut:2], rest[1:cut:2]))
    assert rest[cut + 1 : cut + 4] == ["megatron_dppo.cli", "train", "--config"]
    return env, flags, rest[cut + 4], rest[cut + 5 :]


def test_slurm_dry_run_prints_every_nodes_torchrun_command(tmp_path):
    bin_dir = _fake_tools(tmp_path, ["gpu07", "gpu08", "gpu09"])
    env = _slurm_env(tmp_path, bin_dir, DRY_RUN="1", PYTHON=str(bin_dir / "python-not-to-run"))
    proc = subprocess.run(
        ["bash", str(EXAMPLE / "slurm.sbatch"), "trainer.max_steps=7", "data.system_prompt=solve it"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not (tmp_path / "ran").exists(), (tmp_path / "ran").read_text()  # no srun, no python
    commands = _node_commands(proc.stdout)
    assert sorted(commands) == [0, 1, 2], proc.stdout
    endpoints, ids = set(), set()
    for node, argv in commands.items():
        run_env, flags, config, overrides = _split(argv)
        assert run_env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
        assert flags["--nnodes"] == "3" and flags["--nproc_per_node"] == "8"
        assert flags["--rdzv_backend"] == "c10d"
        assert flags["--rdzv_conf"] == f"is_host={int(node == 0)}"  # the first host serves the rendezvous
        endpoints.add(flags["--rdzv_endpoint"])
        ids.add(flags["--rdzv_id"])
        assert overrides[:4] == [
            "model.hf_dir=/models/Qwen3-32B",
            "data.train=/data/math.jsonl",
            "parallel.nodes=3",
            "parallel.gpus_per_node=8",
        ]
        assert overrides[4:] == ["trainer.max_steps=7", "data.system_prompt=solve it"]
        # what every node would start, the trainer's own config and layout checks accept
        cfg = load_config(str(REPO / config), overrides)
        arch = Arch.from_hf(load_hf_config(str(REPO / "examples" / "qwen3_configs" / "32B")))
        check_layout(cfg, arch, world_size=int(flags["--nnodes"]) * int(flags["--nproc_per_node"]))
        assert cfg.trainer.max_steps == 7 and cfg.data.system_prompt == "solve it"
    assert endpoints == {"gpu07:29500"} and ids == {"4242"}


def test_slurm_submission_runs_the_dry_run_commands(tmp_path):
    """The real path (plan on the batch host, then srun) with srun replaced by a stand-in that runs
    its command once per node, as SLURM_NODEID 0..N-1, each stopping at DRY_RUN: the per-node
    commands equal the dry run's."""
    bin_dir = _fake_tools(tmp_path, ["gpu07", "gpu08", "gpu09"])
    (bin_dir / "srun").write_text(
        '#!/bin/bash\nwhile [[ "$1" == -* ]]; do shift; done\n'
        'for ((k = 0; k < SLURM_NNODES; k++)); do SLURM_NODEID=$k DRY_RUN=1 "$@" || exit; done\n'
    )
    args = ["trainer.max_steps=7", "data.system_prompt=solve it"]
    # the plan pre-check on the batch host needs the architecture's config.json
    env = _slurm_env(tmp_path, bin_dir, HF_DIR="examples/qwen3_configs/32B")
    submitted = subprocess.run(
        ["bash", str(EXAMPLE / "slurm.sbatch"), *args],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    assert submitted.stdout.count("FITS") == 1  # plan ran once, on the batch host, and accepted it
    dry = subprocess.run(
        ["bash", str(EXAMPLE / "slurm.sbatch"), *args],
        env=dict(env, DRY_RUN="1"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert dry.returncode == 0, dry.stderr
    assert _node_commands(submitted.stdout) == _node_commands(dry.stdout)
    assert sorted(_node_commands(submitted.stdout)) == [0, 1, 2]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"NODE_RANK": "2"}, "NODE_RANK=2 must be an integer in 0 .. NNODES-1 = 1"),
        ({"NODE_RANK": "one"}, "NODE_RANK=one"),
        ({"HF_DIR": None}, "HF_DIR"),
        ({"MASTER_ADDR": None}, "MASTER_ADDR"),
    ],
)
def test_launch_script_names_a_bad_variable(tmp_path, change, message):
    env = _clean_env(
        MASTER_ADDR="127.0.0.1",
        NNODES="2",
        NODE_RANK="0",
        HF_DIR=str(TINY_MODEL),
        TRAIN_DATA=str(TINY_DATA),
        DRY_RUN="1",
    )
    for key, value in change.items():
        env.pop(key) if value is None else env.update({key: value})
    proc = subprocess.run(
        ["bash", str(EXAMPLE / "launch_torchrun.sh")], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
    assert "torch.distributed.run" not in proc.stdout


# The founding paper's Table 9 presets (Qwen2.5 / Llama 3.2, GRPO and DAPO with DPPO) through the
# same script, unchanged: preset -> (architecture dir, NNODES; None: the script's default of 4).
TABLE9 = {
    "qwen2.5_7b_grpo": ("qwen2.5_configs/7B-Instruct", "1"),
    "qwen2.5_7b_dapo": ("qwen2.5_configs/7B-Instruct", "1"),
    "llama3.2_3b_grpo": ("llama3.2_configs/3B-Instruct", "1"),
    "llama3.2_3b_dapo": ("llama3.2_configs/3B-Instruct", "1"),
    "qwen2.5_32b_grpo": ("qwen2.5_configs/32B-Instruct", None),
    "qwen2.5_32b_dapo": ("qwen2.5_configs/32B-Instruct", None),
}


@pytest.mark.parametrize("preset", TABLE9)
def test_launch_script_runs_the_table9_presets(tmp_path, preset):
    """launch_torchrun.sh with CONFIG=<preset>, as its header says: the real `plan` pre-check
    accepts the layout (exit 0, FITS), and the torchrun command it then starts (PYTHON is a
    stand-in that runs `plan` and records any other command instead of running it) carries the
    preset and the environment's overrides, which the trainer's config and layout checks accept at
    the world size torchrun would make. The last node is the one started (for 32B, node 3 of 4,
    not the rendezvous host)."""
    hf_dir, nnodes = TABLE9[preset]
    record = tmp_path / "torchrun.argv"
    stand_in = tmp_path / "python"
    stand_in.write_text(
        "#!/bin/bash\n"
        f'if [[ "$1 $2" == "-m megatron_dppo.jobs.plan" ]]; then exec {shlex.quote(sys.executable)} "$@"; fi\n'
        f'printf "%s\\0" "$@" > {shlex.quote(str(record))}\n'
    )
    stand_in.chmod(0o755)
    nodes = int(nnodes or 4)
    env = _clean_env(
        MASTER_ADDR="127.0.0.1",
        NODE_RANK=str(nodes - 1),
        HF_DIR=str(REPO / "examples" / hf_dir),
        TRAIN_DATA="/data/math_train.jsonl",
        CONFIG=f"examples/presets/{preset}.yaml",
        PYTHON=str(stand_in),
        **({"NNODES": nnodes} if nnodes else {}),
    )
    proc = subprocess.run(
        ["bash", str(EXAMPLE / "launch_torchrun.sh"), "trainer.max_steps=3"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "FITS" in proc.stdout, proc.stdout  # the pre-check ran and accepted the layout
    dash_m, module, *rest = record.read_text().split("\0")[:-1]  # the stand-in's arguments
    assert (dash_m, module) == ("-m", "torch.distributed.run")
    cut = rest.index("-m")
    flags = dict(zip(rest[:cut:2], rest[1:cut:2]))
    assert rest[cut + 1 : cut + 4] == ["megatron_dppo.cli", "train", "--config"]
    config, overrides = rest[cut + 4], rest[cut + 5 :]
    assert config == f"examples/presets/{preset}.yaml"
    assert flags["--nnodes"] == str(nodes) and flags["--nproc_per_node"] == "8"
    assert flags["--rdzv_conf"] == f"is_host={int(nodes == 1)}"
    assert overrides == [
        f"model.hf_dir={REPO / 'examples' / hf_dir}",
        "data.train=/data/math_train.jsonl",
        f"parallel.nodes={nodes}",
        "parallel.gpus_per_node=8",
        "trainer.max_steps=3",
    ]
    cfg = load_config(str(REPO / config), overrides)
    check_layout(cfg, Arch.from_hf(load_hf_config(cfg.model.hf_dir)), world_size=nodes * 8)
    assert (cfg.pruning.r_q, cfg.pruning.r_o, cfg.trainer.max_steps) == (0.5, 0.5, 3)
