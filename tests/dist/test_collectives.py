"""Host-side collectives (megatron_dppo/run/collectives.py), gradients gathered under the distributed
optimizer (MegatronPolicy.hf_grads) and the process groups' timeouts, in torchrun workers over gloo
(tests/dist/workers/model/collectives_worker.py, timeout_worker.py). The one-process fallback and the
launch environment: tests/unit/test_distributed.py."""

from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKER = HERE / "workers" / "model" / "collectives_worker.py"


def test_collectives_gloo_and_as_on_nccl(launch):
    res = launch(WORKER, 2, "--case", "collectives")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    assert "COLLECTIVES OK gloo" in res.stdout and "COLLECTIVES OK nccl-placement" in res.stdout


def test_hf_grads_with_distributed_optimizer_dp2(launch):
    res = launch(WORKER, 2, "--case", "dist-optimizer")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    assert "DIST OPTIMIZER GRADS OK" in res.stdout, res.stdout[-3000:]


def test_every_group_gets_parallel_timeout_minutes(launch):
    """Issue 22.5: the world, every Megatron group (gloo ones included, and the expert
    data-parallel gloo group Megatron itself creates without its timeout) run under
    parallel.timeout_minutes, read back from each group's backend (tests/dist/workers/model/timeout_worker.py)."""
    res = launch(HERE / "workers" / "model" / "timeout_worker.py", 1)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    assert "timeouts OK on" in res.stdout
