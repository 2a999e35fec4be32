"""`megatron-dppo train` under torchrun with 2 processes equals the same run in 1 process.

The layouts a cluster run uses, on the tiny model: DP=2 (a vLLM engine per rank), Megatron TP=2
with one vLLM engine over both ranks (parallel.rollout_tp=2), and PP=2. In each, step 1's
completions equal the 1-process run's token for token (sampling seeds come from the prompt's
place in the step, never from a rank), and the losses, grad norms and the parameters after the
steps agree within 1e-5 relative (fp32). A 2-process run killed after a checkpoint resumes and
repeats the uninterrupted run.

The model is the warmed-up tiny addition model with a 4th decoder layer appended whose output
projections are zero (it starts as the identity, so the model keeps its ~25% accuracy and RL
has signal), because PP=2 needs an even number of layers.
"""

import contextlib
import json
import shutil
import signal
import subprocess
import time

import psutil
import pytest
import torch
from safetensors.torch import load_file, save_file
from trainer_runs import (
    REPO,
    STEPS,
    TINY,
    assert_same_run,
    final_weights,
    kill_launcher_alone,
    metrics,
    rollouts,
    run,
    run_env,
    start_logged,
    train_cmd,
    wait_for_first_row,
)

pytestmark = pytest.mark.slow  # training runs in subprocesses: minutes in all


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A 4-layer copy of the tiny model (identity 4th layer) and the 1-process reference run."""
    root = tmp_path_factory.mktemp("dist_train")
    model = root / "model"
    shutil.copytree(TINY / "model", model)
    config = json.loads((model / "config.json").read_text())
    last = config["num_hidden_layers"] - 1
    weights = load_file(model / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    for name in [k for k in weights if k.startswith(f"model.layers.{last}.")]:
        new = name.replace(f"layers.{last}.", f"layers.{last + 1}.")
        zero = name.endswith(("o_proj.weight", "down_proj.weight"))
        t = weights[name]
        weights[new] = (
            torch.zeros_like(t)
            if zero
            else (t.clone() if "norm" in name else 0.02 * torch.randn(t.shape, generator=gen, dtype=t.dtype))
        )
    config["num_hidden_layers"] = last + 2
    if "layer_types" in config:
        config["layer_types"] = config["layer_types"] + config["layer_types"][-1:]
    (model / "config.json").write_text(json.dumps(config, indent=1))
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    run(train_cmd(root, "ref", model, 1))
    return root, model


def test_dp2_bppo_waves_equal_one_process(work, tmp_path):
    """BPPO's waves at DP=2: each rank's engine draws its prompts' later waves, and every rank
    decides them from the gathered groups: the same completions, group sizes and update."""
    root, model = work
    waves = ["algorithm.selection=bppo", "pruning.r_o=0", "rollout.group_size=8", "algorithm.bppo.schedule=waves"]
    run(train_cmd(root, "waves1", model, 1, *waves))
    run(train_cmd(root, "waves-dp2", model, 2, *waves))
    assert_same_run(root / "waves1", root / "waves-dp2", tmp_path)
    sizes = {}
    for row in rollouts(root / "waves1", 1):
        sizes[row["slot"]] = sizes.get(row["slot"], 0) + 1
    assert set(sizes.values()) == {4, 8} and len(sizes) == 8, sizes  # both ends of the rule (seeded)


def test_dp2_rollout_correction_with_starved_minibatches_equals_one_process(work, tmp_path):
    """A rollout correction at DP=2 where mini-batches hold fewer packs than DP ranks (one group a
    mini-batch, three of its four completions pruned: one sequence): the idle rank trains the filler, and the
    run equals the 1-process one (it raised "this micro-batch carries none" in step 1, the other
    rank waiting in the all-reduce: issue 44). tis_seq_mask reads the cap and the geometric bounds."""
    root, model = work
    starved = [
        "pruning.r_q=0",
        "pruning.r_o=0.75",
        "trainer.minibatches_per_step=8",
        "algorithm.rollout_correction=tis_seq_mask",
    ]
    run(train_cmd(root, "corr1", model, 1, *starved))
    run(train_cmd(root, "corr-dp2", model, 2, *starved))
    assert_same_run(root / "corr1", root / "corr-dp2", tmp_path)


def test_tp2_one_engine_over_both_ranks_equals_one_process(work, tmp_path):
    root, model = work
    run(train_cmd(root, "tp2", model, 2, "parallel.tp=2", "parallel.rollout_tp=2", f"trainer.save_hf_every={STEPS}"))
    assert_same_run(root / "ref", root / "tp2", tmp_path)
    # The HF model dir written while training (gathered from both TP ranks) holds exactly the
    # checkpoint's weights, and transformers loads it as it is, tokenizer and chat template too.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = root / "tp2" / "hf" / f"step_{STEPS:06d}"
    written = {k: v for f in sorted(hf.glob("*.safetensors")) for k, v in load_file(f).items()}
    converted = final_weights(root / "tp2", tmp_path)
    assert written.keys() == converted.keys() and all(torch.equal(written[k], converted[k]) for k in written)
    loaded = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    ids = AutoTokenizer.from_pretrained(hf).apply_chat_template([{"role": "user", "content": "12+34="}], tokenize=True)
    ids = torch.tensor([ids["input_ids"] if hasattr(ids, "keys") else ids])  # transformers 5: a BatchEncoding
    reference = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    reference.load_state_dict({**reference.state_dict(), **converted}, strict=True)
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, reference(ids).logits, atol=1e-5, rtol=0)


def test_pp2_equals_one_process(work, tmp_path):
    root, model = work
    run(train_cmd(root, "pp2", model, 2, "parallel.pp=2"))
    assert_same_run(root / "ref", root / "pp2", tmp_path)


def test_dp2_run_killed_after_a_checkpoint_resumes_and_equals_one_process(work, tmp_path):
    """DP=2, one engine per rank: SIGKILL the whole torchrun job once step 1's checkpoint exists,
    resume with --resume: metrics hold each step once, and the run, before the kill and after it,
    equals the uninterrupted 1-process run (step 1's rollouts token for token, every step's
    metrics, the final weights). One run for what were two tests (DP=2 equals one process; a
    killed 2-process run resumes and repeats): each 2-process run costs ~40 s."""
    root, model = work
    cmd = train_cmd(root, "killed", model, 2, "trainer.save_every=1")
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=run_env(), start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    latest = root / "killed" / "checkpoints" / "latest"
    deadline = time.time() + 400
    while not (latest.exists() and latest.read_text().strip()) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    # A crash of the whole job: torchrun and its workers (which run in sessions of their own) at once.
    job = [psutil.Process(proc.pid)] + psutil.Process(proc.pid).children(recursive=True)
    for p in job:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGKILL)
    proc.wait()
    psutil.wait_procs(job, timeout=30)
    saved = int(latest.read_text().strip().split("_")[1])
    assert saved < STEPS, f"the run finished before it could be killed (saved step {saved})"
    run(train_cmd(root, "killed", model, 2, "trainer.save_every=1", resume=True))
    got = metrics(root / "killed")
    assert sorted(got) == list(range(1, STEPS + 1))
    assert_same_run(root / "ref", root / "killed", tmp_path, steps=range(1, STEPS + 1))


def test_a_killed_launcher_leaves_no_rank_running(work):
    """SIGKILL reaches torchrun alone (an OOM kill, a lost node agent): each rank gets SIGTERM from
    the kernel (PR_SET_PDEATHSIG), finishes its step, saves a checkpoint together with the other
    rank and exits; nothing of the run is left."""
    root, model = work
    log = root / "orphans.log"  # the ranks' screen, shown when an assertion fails
    proc = start_logged(train_cmd(root, "orphans", model, 2, "trainer.max_steps=200", "trainer.save_every=0"), log)
    wait_for_first_row(root / "orphans", proc)
    ranks = psutil.Process(proc.pid).children(recursive=True)
    assert len([p for p in ranks if "megatron_dppo.cli" in " ".join(p.cmdline())]) == 2
    alive = kill_launcher_alone(proc, ranks)
    screen = log.read_text()[-3000:]
    assert not alive, f"{len(alive)} process(es) of the run outlived its launcher\n{screen}"
    done = max(metrics(root / "orphans"))
    latest = root / "orphans" / "checkpoints" / "latest"
    assert latest.exists() and latest.read_text().strip() == f"step_{done:06d}", screen
    assert "stopping after step" in screen, screen
