"""`megatron-dppo train` on a mixture-of-experts model: 1 process vs torchrun with expert parallel 2.

The model is tools/make_tiny_moe.py's (4 experts, top-2, upcycled from the warmed-up tiny dense
model so the addition task has informative rewards), the config examples/tiny/moe.yaml with
test_trainer_dist.py's small step budget, and two epochs per step: the second pass trains
against the rollout policy's log-probs (the pi_old pass runs at EP=2 too) with a non-zero loss.

At world 2, parallel.ep=2 makes both ranks one expert-parallel group (2 experts each) and, the
dense layout being TP=1 x PP=1, dense data parallel 2: Megatron lays the expert groups (expert-TP
x EP x expert-DP x PP) over the same world as the dense ones (TP x DP x PP), so expert DP is
world / (ep x etp x pp) = 1. "EP=2 with DP=2" is exactly this run; EP=2 with DP=2 of the experts
too would take 4 ranks. Each rank has its own vLLM engine holding every expert (the weight sync
gathers them over the EP group).
"""

import json
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file
from trainer_runs import (
    REPO,
    STEPS,
    TINY,
    assert_same_rollouts,
    assert_same_run,
    final_weights,
    metrics,
    rel_close,
    rollouts,
    run,
    train_cmd,
)

sys.path.insert(0, str(REPO / "tools"))
import make_tiny_moe  # noqa: E402

pytestmark = pytest.mark.slow  # training runs in subprocesses: minutes in all

CONFIG = REPO / "examples" / "tiny" / "moe.yaml"
EXTRA = ["trainer.epochs_per_step=2"]
COMPARED = ("train/loss", "train/grad_norm", "train/moe_load_imbalance", "reward/mean", "tokens/trained")


def moe_cmd(root, name, nproc, *overrides, resume=False):
    """trainer_runs.train_cmd on examples/tiny/moe.yaml and the test's MoE model."""
    cmd = train_cmd(root, name, root / "model", nproc, *EXTRA, *overrides, resume=resume)
    cmd[cmd.index(str(TINY / "addition.yaml"))] = str(CONFIG)
    return cmd


def report(ref_dir, run_dir, steps) -> str:
    """Max relative differences of loss and grad norm per step (printed with -s)."""
    ref, got = metrics(ref_dir), metrics(run_dir)
    parts = []
    for s in steps:
        rel = {k: abs(got[s][k] - ref[s][k]) / max(abs(ref[s][k]), 1e-30) for k in ("train/loss", "train/grad_norm")}
        parts.append(
            f"step {s}: loss {ref[s]['train/loss']:.6g} rel {rel['train/loss']:.1e}, "
            f"grad_norm {ref[s]['train/grad_norm']:.6g} rel {rel['train/grad_norm']:.1e}"
        )
    return "; ".join(parts)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """The tiny MoE and the 1-process (EP=1) reference run."""
    root = tmp_path_factory.mktemp("moe_train")
    make_tiny_moe.build(str(root / "model"))
    run(moe_cmd(root, "ref", 1))
    return root


@pytest.fixture(scope="module")
def ep2(work):
    """The same run under torchrun at parallel.ep=2, checkpointed after every step, with an HF
    model dir written at the end."""
    run(moe_cmd(work, "ep2", 2, "parallel.ep=2", "trainer.save_every=1", f"trainer.save_hf_every={STEPS}"))
    return work / "ep2"


def test_ep2_equals_one_process(work, ep2, tmp_path):
    """Step 1's completions token for token, losses, grad norms, expert load and the weights
    after the steps (test_trainer_dist.assert_same_run: within 1e-5 relative)."""
    assert_same_run(work / "ref", ep2, tmp_path)
    ref, got = metrics(work / "ref"), metrics(ep2)
    assert ref[1]["reward/mean"] > 0  # the upcycled model earns rewards: RL has signal
    for s in range(1, STEPS + 1):
        assert got[s]["train/optimizer_steps"] == ref[s]["train/optimizer_steps"] == 2
        assert abs(ref[s]["train/loss"]) > 1e-4  # the second epoch's loss: a comparison that can fail
        assert ref[s]["train/moe_load_imbalance"] > 1.0 and ref[s]["train/moe_aux_loss"] == 0.0
        # vLLM's log-probs of the sampled tokens equal the policy's at the first update: the weight
        # sync (every expert, gathered over EP) reached each rank's engine
        assert got[s]["train/logprob_gap_vllm"] < 1e-4 and ref[s]["train/logprob_gap_vllm"] < 1e-4
        for key in COMPARED:
            assert rel_close(got[s][key], ref[s][key]), (s, key, got[s][key], ref[s][key])
    print("EP=2 vs 1 process:", report(work / "ref", ep2, range(1, STEPS + 1)))


def test_hf_dir_written_at_ep2_holds_every_expert(work, ep2, tmp_path):
    """trainer.save_hf_every at EP=2: the HF model dir holds all 4 experts of each sparse layer,
    exactly the checkpoint's weights (converted independently), and transformers loads it."""
    from transformers import AutoModelForCausalLM

    hf = ep2 / "hf" / f"step_{STEPS:06d}"
    written = {k: v for f in sorted(hf.glob("*.safetensors")) for k, v in load_file(f).items()}
    converted = final_weights(ep2, tmp_path)
    start = load_file(work / "model" / "model.safetensors")
    assert written.keys() == converted.keys() == start.keys()
    assert sum(k.endswith("mlp.experts.3.down_proj.weight") for k in written) == 2  # layers 0 and 2
    assert all(torch.equal(written[k], converted[k]) for k in written)
    loaded = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    state = loaded.state_dict()  # transformers 5 holds each layer's experts as 3-D tensors
    for i in (0, 2):
        gate_up = torch.stack(
            [
                torch.cat([written[f"model.layers.{i}.mlp.experts.{e}.{w}_proj.weight"] for w in ("gate", "up")])
                for e in range(4)
            ]
        )
        assert torch.equal(state[f"model.layers.{i}.mlp.experts.gate_up_proj"], gate_up)
        assert torch.equal(state[f"model.layers.{i}.mlp.gate.weight"], written[f"model.layers.{i}.mlp.gate.weight"])


def test_checkpoint_saved_at_ep2_resumes_at_ep1(work, ep2, tmp_path):
    """The EP=2 run as if killed after step 1 (its step-1 checkpoint, metrics and rollouts), resumed
    in one process: step 2 repeats the uninterrupted EP=1 run's step 2 (its completions token for
    token, losses, grad norms) and the weights after it agree. Experts restored in the wrong place,
    or Adam's moments lost, would change step 2's completions or its update."""
    resumed = work / "resumed"
    shutil.copytree(ep2, resumed, ignore=shutil.ignore_patterns("hf", f"step_{STEPS:06d}*"))
    (resumed / "checkpoints" / "latest").write_text("step_000001\n")
    rows = [r for r in map(json.loads, (resumed / "metrics.jsonl").read_text().splitlines()) if r["step"] == 1]
    (resumed / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert sorted(p.name for p in (resumed / "checkpoints").iterdir()) == ["latest", "step_000001"]
    run(moe_cmd(work, "resumed", 1, "trainer.save_every=1", resume=True))
    assert sorted(metrics(resumed)) == list(range(1, STEPS + 1))
    assert_same_rollouts(rollouts(resumed, 2), rollouts(work / "ref", 2))
    assert_same_run(work / "ref", resumed, tmp_path, steps=range(2, STEPS + 1))
    print("resumed at EP=1 vs uninterrupted EP=1:", report(work / "ref", resumed, range(2, STEPS + 1)))
