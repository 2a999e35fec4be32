"""Worker: the stall watchdog in a real torchrun job over gloo, without the trainer (seconds).

Every rank loops over steps: phase "train" (a little work), then phase "sync" and an all-reduce
through megatron_dppo.run.collectives, as the trainer's steps end. At --stall-step, rank --stall-rank
stops: `sigstop` SIGSTOPs itself (the whole process, its watchdog threads too: what a debugger, a
frozen node or a swapped-out process looks like), `sleep` hangs in phase "reward" with its threads
alive. The other ranks then wait in the all-reduce; their watchdogs must name the stalled rank and
end the job. Without a watchdog the job would never end (the test's timeout fails it).
"""

import argparse
import os
import signal
import time

import torch.distributed as dist

from megatron_dppo.run import collectives as mdist
from megatron_dppo.run.watchdog import StallWatchdog, default_store


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--timeout", type=float, required=True)
    ap.add_argument("--stall", choices=["sigstop", "sleep"], required=True)
    ap.add_argument("--stall-rank", type=int, default=1)
    ap.add_argument("--stall-step", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = mdist.world()
    watchdog = StallWatchdog(args.timeout, rank=rank, world=world, store=default_store()).start()
    for step in range(1, args.steps + 1):
        watchdog.phase("train", step)
        time.sleep(0.05)
        if rank == args.stall_rank and step == args.stall_step:
            print(f"rank {rank} stalls at step {step} ({args.stall}), pid {os.getpid()}", flush=True)
            if args.stall == "sigstop":
                os.kill(os.getpid(), signal.SIGSTOP)
            else:
                watchdog.phase("reward", step)
                time.sleep(600)
        watchdog.phase("sync", step)
        mdist.all_reduce_sum([step])
    watchdog.stop()
    print(f"rank {rank} finished all steps", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
