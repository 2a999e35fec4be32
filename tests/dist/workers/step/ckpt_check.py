"""Worker: checkpoints resume exactly, survive a kill, and load at another TP/PP layout.

--phase full      train steps 1..N, write losses to --out
--phase killed    train steps 1..K, save at K, then SIGKILL itself (no clean exit)
--phase resume    load the latest checkpoint, train K+1..N, write losses to --out
  --distributed-optimizer  (full, resume) Adam state sharded over DP; --state-out PREFIX: each
                    rank writes PREFIX.rank<r>.pt: its weights and Adam state after the last step
  --unstepped-ckpt ROOT  (full) also save step 0 there, before the first update (no Adam state)
--phase logprobs  load the latest checkpoint (model only) and write log-probs of a fixed batch
  --resume-also CKPT,OUT,STATE_OUT (repeatable) then resume that checkpoint root too, into a new
                    policy in this process (each start costs ~10 s), as --ckpt/--out/--state-out would
  --logprobs-at LAYOUTS  (resume) then, in this process (each start costs ~10 s), do what phase
                    logprobs does at each of these layouts (comma-separated tp<N> or pp<N>; the
                    world is kept, so tp1 on 2 ranks is DP=2), writing --out's stem + _<layout>.pt
--phase save-steps   save checkpoints at --save-steps (with a prompt history), --keep-last of them;
                     with --resume, load the latest checkpoint first (its run continues)
--phase load      load the latest checkpoint; print "loaded step N", or the CheckpointError (exit 3);
                  --other-model: into a model of another shape (hidden 128); --then ROOT (repeatable):
                  load those roots' latest checkpoints too, one after another in this process, each
                  result under a line "== load ROOT" (exit 3 if any failed)
--phase save-disk-full  save with every shard write failing as on a full disk; print the OSError (exit 4)
--phase hold-save start a reward pool with a check hung in it, then save with a shard writer
                  that announces itself (touches --out) and blocks: the test SIGKILLs this process
                  there and checks that no process it started survives
"""

import argparse
import json
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist
from grad_check import MAX_NEW, B, G, hf_model, make_problem, my_microbatches

from megatron_dppo.algorithms import losses
from megatron_dppo.config import AlgorithmConfig, OptimConfig
from megatron_dppo.megatron import destroy_parallel, initialize_parallel
from megatron_dppo.megatron.checkpoint import (  # noqa: E402
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    new_run_id,
    save_checkpoint,
)
from megatron_dppo.megatron.policy import MegatronPolicy


def batch_for_step(model, step, dp_rank, dp_size):
    samples, lengths, w_q, *_ = make_problem(model, 0.5, 0.5, seed=1000 + step)
    denom = losses.full_batch_denominator(
        "token-mean",
        num_prompts=B,
        group_size=G,
        completion_lengths=lengths,
        prompt_weight=w_q,
        max_response_length=MAX_NEW,
    )
    return my_microbatches(samples, 24, dp_rank, dp_size), denom


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--phase",
        required=True,
        choices=["full", "killed", "resume", "logprobs", "save-steps", "load", "hold-save", "save-disk-full"],
    )
    ap.add_argument("--other-model", action="store_true")
    ap.add_argument("--then", action="append", default=[])
    ap.add_argument("--save-steps", default="")
    ap.add_argument("--keep-last", type=int, default=2)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--save-at", type=int, default=3)
    ap.add_argument("--distributed-optimizer", action="store_true")
    ap.add_argument("--state-out")
    ap.add_argument("--unstepped-ckpt", help="(full) also save step 0, before the first update, under this root")
    ap.add_argument("--resume-also", action="append", default=[], help="(resume) CKPT,OUT,STATE_OUT: then that")
    ap.add_argument("--logprobs-at", default="", help="(resume) then phase logprobs at these layouts: tp1,pp2,...")
    args = ap.parse_args()
    initialize_parallel(args.tp, args.pp, seed=0)
    from megatron.core import parallel_state as ps

    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    model, policy = build_policy(args)

    if args.phase in ("save-steps", "load", "hold-save", "save-disk-full"):
        globals()["phase_" + args.phase.replace("-", "_")](args, policy)
        destroy_parallel()
        return

    if args.phase == "logprobs":
        write_logprobs(args.ckpt, model, policy, args.out)
        destroy_parallel()
        return

    runs = [(args.ckpt, args.out, args.state_out)]
    if args.phase == "resume":  # and then each --resume-also run, from a new policy in this process
        runs += [tuple(x.split(",")) for x in args.resume_also]
    for i, (ckpt, out, state_out) in enumerate(runs):
        if i:
            model, policy = build_policy(args)
        train(args, model, policy, ckpt, out, state_out, dp_rank, dp_size)
    for layout in filter(None, args.logprobs_at.split(",")):
        destroy_parallel(world=False)
        args.tp, args.pp = (int(layout[2:]), 1) if layout.startswith("tp") else (1, int(layout[2:]))
        initialize_parallel(args.tp, args.pp, seed=0)
        model, policy = build_policy(args)
        write_logprobs(args.ckpt, model, policy, args.out.removesuffix(".json") + f"_{layout}.pt")
    destroy_parallel()


def train(args, model, policy, ckpt, out, state_out, dp_rank, dp_size):
    """Phases full, killed and resume: train (from ckpt's latest checkpoint when resuming), save at
    --save-at, write the record to out and the trained state under state_out."""
    first = 1
    if args.phase == "resume":
        state = load_checkpoint(latest_checkpoint(ckpt), policy)
        first = state["step"] + 1
    last = args.save_at if args.phase == "killed" else args.steps
    if args.unstepped_ckpt:
        save_checkpoint(args.unstepped_ckpt, 0, policy, {"note": "test"}, run_id=new_run_id())
    record = {}
    for step in range(first, last + 1):
        mbs, denom = batch_for_step(model, step, dp_rank, dp_size)
        m = policy.train_step(mbs, denom)
        record[step] = [m["loss"], m["grad_norm"], m["lr"]]
        if step == args.save_at and args.phase != "resume":
            save_checkpoint(ckpt, step, policy, {"note": "test"}, run_id=new_run_id())
    if args.phase == "killed":
        os.kill(os.getpid(), signal.SIGKILL)
    if dist.get_rank() == 0 and out:
        with open(out, "w") as f:
            json.dump(record, f)
    if state_out:
        torch.save(trained_state(policy), f"{state_out}.rank{dist.get_rank()}.pt")


def build_policy(args):
    """(the HF model, a MegatronPolicy holding its weights) at the current parallel layout."""
    cfg, model = hf_model()
    if args.other_model:
        from tiny_models import tiny_qwen3_model

        cfg, model = tiny_qwen3_model(0, vocab_size=cfg.vocab_size, hidden_size=128, max_position_embeddings=64)
    policy = MegatronPolicy(
        cfg,
        OptimConfig(lr=3e-3, warmup_steps=2, decay_steps=10, decay_style="cosine"),
        AlgorithmConfig(loss_agg="token-mean", clip_high=0.28),
        distributed_optimizer=args.distributed_optimizer,
    )
    policy.load_hf_state_dict({k: v for k, v in model.state_dict().items() if k != "lm_head.weight"})
    return model, policy


def write_logprobs(ckpt, model, policy, out_path):
    """Load ckpt's latest checkpoint (model only); one rank writes the log-probs of a fixed batch."""
    from megatron.core import parallel_state as ps

    load_checkpoint(latest_checkpoint(ckpt), policy, load_optimizer=False)
    mbs, _ = batch_for_step(model, 99, 0, 1)
    out = policy.compute_logprobs(mbs)
    if out is not None and ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
        torch.save([o.cpu() for o in out], out_path)


def trained_state(policy) -> dict:
    """This rank's model weights and its Adam state (exp_avg, exp_avg_sq, step of each parameter
    the inner torch optimizer holds: a DP shard of each under the distributed optimizer)."""
    adam = {}
    for c, opt in enumerate(getattr(policy.optimizer, "chained_optimizers", [policy.optimizer])):
        for g, group in enumerate(opt.optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                for name, value in opt.optimizer.state.get(p, {}).items():
                    adam[f"{c}.{g}.{i}.{name}"] = torch.as_tensor(value).detach().cpu().clone()
    weights = {k: v.detach().cpu().clone() for k, v in policy.model.module.state_dict().items() if torch.is_tensor(v)}
    return {"weights": weights, "adam": adam}


def phase_save_steps(args, policy):
    from megatron_dppo.algorithms.history import PromptHistory

    run_id = new_run_id()
    if args.resume:  # the resumed run saves under the loaded checkpoint's run_id
        state = load_checkpoint(latest_checkpoint(args.ckpt), policy)
        print("resumed step", state["step"], flush=True)
        run_id = state["run_id"]
    history = PromptHistory()
    history.update(["a", "b"], torch.tensor([[0.0, 1.0], [1.0, 1.0]]))
    _, model = hf_model()
    policy.train_step(*batch_for_step(model, 1, 0, 1))  # an optimizer with state to save
    for step in map(int, args.save_steps.split(",")):
        data = {"data": {"epoch": 0, "pos": step}}
        save_checkpoint(args.ckpt, step, policy, data, history, keep_last=args.keep_last, run_id=run_id)


def phase_load(args, policy):
    import warnings

    from megatron_dppo.run.quiet import quiet_libraries

    warnings.resetwarnings()  # as a user's process has them (run_workers sets PYTHONWARNINGS=ignore)
    warnings.simplefilter("default")
    quiet_libraries()  # what the CLI does
    failed = False
    for root in [args.ckpt, *args.then]:  # one process for several loads: each start costs ~10 s
        print(f"== load {root}" if args.then else "loading", flush=True)
        try:
            state = load_checkpoint(latest_checkpoint(root), policy)
        except CheckpointError as e:
            print(f"CheckpointError: {e}", flush=True)
            failed = True
            continue
        print("loaded step", state["step"], "history" if "history_path" in state else "no history", flush=True)
    if failed:
        sys.exit(3)


def phase_save_disk_full(args, policy):
    import errno

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    def full_disk(*a, **k):  # what a write() on a full disk raises: no file name in it
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    filesystem_async._write_item = full_disk
    try:
        save_checkpoint(args.ckpt, 5, policy, {}, run_id=new_run_id())
    except OSError as e:
        print(f"OSError: {e}", flush=True)
        sys.exit(4)


def phase_hold_save(args, policy):
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    from megatron_dppo.rewards import RewardScorer

    sys.path.insert(
        0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..")
    )  # tests/: reward_fixtures
    scorer = RewardScorer("reward_fixtures:hang_on_leading_one", timeout_s=600, num_workers=2)
    threading.Thread(target=scorer.score, args=(["1 hangs", "2"], ["3", "2"]), daemon=True).start()
    write = FileSystemWriterAsync.write_preloaded_data

    def slow_write(*a, **k):  # a disk that stops answering, in whichever process writes shards
        with open(args.out, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(600)
        return write(*a, **k)

    FileSystemWriterAsync.write_preloaded_data = staticmethod(slow_write)
    time.sleep(1.0)  # let the hung check reach its worker
    if os.environ.get("CKPT_CHECK_MEGATRON_WRITER"):  # Megatron's own writer (forked processes + Manager)
        from megatron.core import dist_checkpointing

        os.makedirs(args.ckpt, exist_ok=True)
        dist_checkpointing.save({"model": policy.model.module.sharded_state_dict()}, args.ckpt)
    else:
        save_checkpoint(args.ckpt, 1, policy, {}, run_id=new_run_id())


if __name__ == "__main__":
    main()
