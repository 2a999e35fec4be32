"""`megatron-dppo` console script: one subcommand per job."""
from __future__ import annotations

import argparse
import sys


def _verify_unbiased(args) -> int:
    from megatron_dppo.algorithms.losses import LOSS_AGGS
    from megatron_dppo.unbiased_check import CheckConfig, run_check

    strategies = args.strategy or ["dppo"]
    aggs = args.loss_agg or (list(LOSS_AGGS) if args.all_aggs else ["seq-mean-token-mean"])
    all_ok = True
    for strategy in strategies:
        for agg in aggs:
            cfg = CheckConfig(strategy=strategy, num_prompts=args.num_prompts, group_size=args.group_size,
                              r_q=args.r_q, r_o=args.r_o, loss_agg=agg, advantage=args.advantage,
                              ratio_type=args.ratio_type, kl_coef=args.kl_coef, draws=args.draws,
                              seed=args.seed)
            result = run_check(cfg)
            print(result.summary(cfg), flush=True)
            all_ok &= result.unbiased
    print("all unbiased" if all_ok else "bias detected beyond Monte Carlo noise")
    return 0 if all_ok else 1


def _train(args) -> int:
    from megatron_dppo.config import load_config

    cfg = load_config(args.config, args.overrides)  # fails fast, before the heavy imports
    from megatron_dppo.trainer import Trainer
    trainer = Trainer(cfg, resume=args.resume)
    try:
        trainer.train()
    finally:
        trainer.close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-dppo", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="DPPO/GRPO training (the main job); under torchrun for several processes")
    t.add_argument("--config", required=True, help="YAML config (see examples/)")
    t.add_argument("--resume", action="store_true", help="continue from the run's latest checkpoint")
    t.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.max_steps=5 pruning.r_q=0.5")
    t.set_defaults(func=_train)

    sub.add_parser("plan", help="per-GPU memory plan of a config; refuses layouts that cannot fit "
                                "(megatron-dppo plan --config FILE [overrides] [--json])")

    v = sub.add_parser("verify-unbiased", help="Monte Carlo check: pruned+reweighted gradient vs full batch")
    v.add_argument("--strategy", action="append", choices=["none", "dppo", "reverse", "cppo", "greso"],
                   help="pruning strategy (repeatable; default dppo)")
    v.add_argument("--loss-agg", action="append",
                   choices=["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"],
                   help="loss aggregation (repeatable; default seq-mean-token-mean)")
    v.add_argument("--all-aggs", action="store_true", help="check every loss aggregation")
    v.add_argument("--num-prompts", "-B", type=int, default=16)
    v.add_argument("--group-size", "-G", type=int, default=8)
    v.add_argument("--r-q", type=float, default=0.5, help="prompt pruning ratio")
    v.add_argument("--r-o", type=float, default=0.5, help="completion pruning ratio")
    v.add_argument("--advantage", choices=["grpo", "drgrpo"], default="grpo")
    v.add_argument("--ratio-type", choices=["token", "sequence"], default="token",
                   help="token: GRPO/DAPO ratio; sequence: GSPO")
    v.add_argument("--kl-coef", type=float, default=0.0)
    v.add_argument("--draws", type=int, default=4000, help="Monte Carlo mask draws")
    v.add_argument("--seed", type=int, default=0)
    v.set_defaults(func=_verify_unbiased)
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["plan"]:  # the planner owns its arguments (config + dotted overrides)
        from megatron_dppo.plan import plan_main
        return plan_main(argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
