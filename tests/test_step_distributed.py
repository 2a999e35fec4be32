"""DPPO inside Megatron's distributed step: the gradient does not depend on the layout.

Each case launches tests/dist_step/grad_check.py (2 processes under torchrun over gloo, or 1):
every rank compares the Megatron gradient of the DPPO loss with a single-process reference on
the HF model (plain PyTorch), for every loss aggregation, GSPO, KL, pruning weights on and off,
and 1 vs several micro-batches per rank.
"""
from pathlib import Path

import pytest

WORKER = Path(__file__).parent / "dist_step" / "grad_check.py"


# TP=2 runs with selective and PP=2 with full activation recomputation: recomputing must not
# change the gradient either (plain TP=2 / PP=2 forwards are compared in test_megatron_model.py).
@pytest.mark.parametrize("nproc,tp,pp,recompute", [(1, 1, 1, "none"), (2, 1, 1, "none"), (2, 2, 1, "selective"),
                                                   (2, 1, 2, "full")],
                         ids=["single", "dp2", "tp2-selective-recompute", "pp2-full-recompute"])
def test_megatron_gradient_equals_single_process_reference(launch, nproc, tp, pp, recompute):
    res = launch(WORKER, nproc, "--tp", str(tp), "--pp", str(pp), "--recompute", recompute)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    assert "GRAD CHECK PASSED" in res.stdout
    # 4 loss settings x 2 pruning settings x 2 micro-batch splits, all compared
    assert res.stdout.count("\nok ") + res.stdout.startswith("ok ") == 16


def test_check_detects_per_token_normalisation(launch):
    """Negative control: Megatron's default 1/num_tokens gradient scaling must be caught."""
    res = launch(WORKER, 2, "--negative-control")
    assert res.returncode != 0
    assert "relative grad error" in res.stdout + res.stderr


def test_megatron_gradient_mean_over_masks_is_the_full_batch_gradient(launch):
    """Monte Carlo through the Megatron path (DP=2): the mean DPPO gradient over mask draws
    approaches the unpruned gradient; pruning without reweighting does not."""
    res = launch(WORKER, 2, "--monte-carlo", "120")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    assert "MONTE CARLO PASSED" in res.stdout
