"""`megatron-dppo` console script: one subcommand per job."""

from __future__ import annotations

import argparse
import os
import sys
from typing import get_args

from megatron_dppo.algorithms.choices import AdvantageKind, LossAgg, RatioType, RolloutCorrection


def _verify_unbiased(args) -> int:
    from megatron_dppo.algorithms.pruning import STRATEGIES
    from megatron_dppo.jobs.verify_unbiased import CheckConfig, run_check, run_dynamic_check

    strategies = args.strategy or ["dppo"]
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        print(f"verify-unbiased: --strategy must be one of {sorted(STRATEGIES)}, got {unknown[0]!r}", file=sys.stderr)
        return 2
    aggs = args.loss_agg or (list(get_args(LossAgg)) if args.all_aggs else ["seq-mean-token-mean"])
    corrected = args.rollout_correction != "none" or args.staleness or args.negative_control != "none" or args.partial
    bad = _correction_arguments_error(args) if corrected else ""
    if bad:
        print(f"verify-unbiased: {bad}", file=sys.stderr)
        return 2
    if args.method:
        return _verify_methods(args, strategies, aggs)
    failures, checked = _verify_rollout_correction(args) if corrected else ([], None)
    all_ok = True
    for strategy in strategies:
        for agg in aggs:
            cfg = CheckConfig(
                strategy=strategy,
                num_prompts=args.num_prompts,
                group_size=args.group_size,
                r_q=args.r_q,
                r_o=args.r_o,
                loss_agg=agg,
                advantage="drgrpo" if corrected else args.advantage,
                ratio_type=args.ratio_type,
                kl_coef=args.kl_coef,
                draws=args.draws,
                seed=args.seed,
                max_resample_rounds=args.max_resample_rounds,
                refill_by=args.refill_by,
                fixed_order=args.fixed_order,
                overlong_filter=args.overlong_filter,
                without_prompt_weight=args.without_prompt_weight,
                rollout_correction=args.rollout_correction,
                staleness=args.staleness,
                negative_control=args.negative_control,
                partial=args.partial,
                rollout_correction_cap=args.rollout_correction_cap,
            )
            try:
                result = run_dynamic_check(cfg) if args.dynamic_sampling else run_check(cfg)
            except ValueError as e:
                print(f"verify-unbiased: {e}", file=sys.stderr)
                return 2
            print(result.summary(cfg), flush=True)
            all_ok &= result.unbiased
            if corrected and getattr(result, "error", ""):
                failures.append(f"{strategy} {agg} + {args.rollout_correction}: {result.error}")
    if corrected:
        return _correction_verdict(args, failures, checked)
    print("all unbiased" if all_ok else "bias detected beyond Monte Carlo noise")
    return 0 if all_ok else 1


def _correction_arguments_error(args) -> str:
    """What --rollout-correction / --staleness / --negative-control cannot be combined with ("" if fine)."""
    if args.partial and not args.staleness:
        return "--partial needs --staleness >= 1: a completion continued under new weights is one update behind or more"
    if args.negative_control == "partial-one-policy" and not args.partial:
        return "--negative-control partial-one-policy needs --partial (it mislabels the tokens of a partial rollout)"
    if args.dynamic_sampling:
        return "--dynamic-sampling checks the refill rule without a rollout correction: drop it, or drop " + (
            "--rollout-correction/--staleness/--negative-control"
        )
    if args.method:
        return "--method checks the methods' own losses without a rollout correction: drop one of the two"
    if args.kl_coef:
        return (
            "--kl-coef must be 0 with --rollout-correction/--staleness: the correction weighs the policy-gradient "
            "term only (losses.corrected_aggregate), so the check's on-policy target has no KL term"
        )
    return ""


def _verify_rollout_correction(args):
    """The exact table of megatron_dppo/jobs/verify_rollout.py on a toy policy (every kind's bias against
    the on-policy gradient and its bound; the versions that sampled and trained) -> (the reasons the
    run fails: a bias beyond its bound, an untruncated estimator not exact, a recommended or the
    checked kind more biased than no correction; the checked kind's row)."""
    from megatron_dppo.jobs.verify_rollout import RolloutCheckConfig, describe_setting, run_rollout_checks

    cfg = RolloutCheckConfig(
        length=3, seed=args.seed, staleness=args.staleness, control=args.negative_control, partial=args.partial
    )
    if args.rollout_correction_cap is not None:
        cfg.cap = args.rollout_correction_cap
    print(f"rollout correction: {describe_setting(cfg)}", flush=True)
    rows = run_rollout_checks(cfg, checked=args.rollout_correction)
    for row in rows:
        print(f"rollout correction: {row.line()}", flush=True)
    checked = next(row for row in rows if "checked" in row.role)
    failures = dict.fromkeys(row.failure for row in rows if row.failure)  # at cap inf a kind is also a reference row
    return list(failures), checked


def _correction_verdict(args, failures: list[str], checked) -> int:
    """The last line under --rollout-correction / --staleness: what counts against the run, or
    what passed, and the recommendation (never "all unbiased" when a kind is biased)."""
    from megatron_dppo.jobs.verify_rollout import recommended_correction

    setting = f"staleness {args.staleness}" if args.staleness else "a bf16/MoE rollout (staleness 0)"
    setting += " with partial rollouts" if args.partial else ""
    rec = f"recommended for {setting}: {recommended_correction(args.staleness)} (docs/algorithm.md section 8)"
    if failures:
        print(f"bias detected: {'; '.join(failures)}; {rec}")
        return 1
    r = checked.result
    print(
        f"no line counts against {r.kind}: {r.verdict} on the toy (no correction's bias {r.none_bias:.3g}) and no "
        f"bias beyond its bound in DPPO's Monte Carlo check; every other BIASED line is within its bound; {rec}"
    )
    return 0


def _verify_methods(args, strategies, aggs) -> int:
    """--method: each method of docs/methods.md, biased by design against GRPO, and DPPO unbiased for
    its own full-batch loss (megatron_dppo/jobs/verify_methods.py)."""
    from megatron_dppo.jobs.verify_methods import METHODS, run_method_check
    from megatron_dppo.jobs.verify_unbiased import CheckConfig

    methods = list(METHODS) if "all" in args.method else args.method
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        print(f"verify-unbiased: --method must be one of {list(METHODS)} or all, got {unknown[0]!r}", file=sys.stderr)
        return 2
    ok = True
    for method in methods:
        for agg in aggs:
            settings = dict(num_prompts=args.num_prompts, group_size=args.group_size, r_q=args.r_q, r_o=args.r_o)
            settings.update(loss_agg=agg, kl_coef=args.kl_coef, draws=args.draws, seed=args.seed)
            cfg = CheckConfig(strategy=strategies[0], method=method, **settings)
            result = run_method_check(cfg)
            print(result.summary(cfg), flush=True)
            ok &= result.unbiased
    print("DPPO unbiased for every method's own loss" if ok else "bias detected beyond Monte Carlo noise")
    return 0 if ok else 1


def _at_least(low, kind=int):
    """An argparse type: a number of `kind` >= low; anything else is argparse's one-line usage error."""
    what = "an integer" if kind is int else "a number"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected {what} >= {low:g}, got {text}")
        return value

    return parse


def _train(args) -> int:
    from megatron_dppo.config import load_config, validate
    from megatron_dppo.run.quiet import quiet_libraries

    cfg = load_config(args.config, args.overrides, check=False)  # fails fast, before the heavy imports
    quiet_libraries(verbose=cfg.logging.verbose)  # before torch is imported (validate imports it)
    from megatron_dppo.run.collectives import set_launch_env_defaults

    set_launch_env_defaults()  # CUDA_DEVICE_MAX_CONNECTIONS, the allocator: before CUDA starts
    validate(cfg)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # model dirs are local: never wait on a hub
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a rank under torchrun: stop (and save) if the launcher dies
        import signal

        from megatron_dppo.run.process import die_with_parent

        die_with_parent(signal.SIGTERM)
    from megatron_dppo.train.trainer import StopNow, StopRequested, Trainer

    roles = None
    if cfg.parallel.rollout_ranks and "RANK" in os.environ:  # dedicated rollout ranks: split the world
        from datetime import timedelta

        from megatron_dppo.run.bridge import split_world

        roles = split_world(cfg.parallel.rollout_ranks, timedelta(minutes=cfg.parallel.timeout_minutes))
        global _SKIP_FINALIZATION
        _SKIP_FINALIZATION = True
        if roles.is_rollout:
            from megatron_dppo.train.rollout_rank import serve

            return serve(cfg, roles)
    trainer, stop_now = None, False
    try:
        trainer = Trainer(cfg, resume=args.resume, overwrite=args.overwrite, roles=roles)
        trainer.train()
    except StopRequested as stop:
        stop_now = isinstance(stop, StopNow)
        return 130 if str(stop) == "SIGINT" else 143  # 128 + the signal: a scheduler sees the interruption
    finally:
        if trainer is not None:
            trainer.close(stop_rollout_ranks=not stop_now)
    return 0


def _evaluate(args) -> int:
    from megatron_dppo.config import load_config, validate
    from megatron_dppo.run.quiet import quiet_libraries

    cfg = load_config(args.config, args.overrides, check=False)
    quiet_libraries(verbose=cfg.logging.verbose)
    if not cfg.data.train:  # validate() asks for training data, which evaluate never reads
        cfg.data.train = "(not read by evaluate)"
    validate(cfg)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from megatron_dppo.jobs.evaluate import run_evaluate

    run_evaluate(cfg, checkpoint=args.checkpoint, out_dir=args.out_dir)
    return 0


def _run_reporting_errors(func, args) -> int:
    """Run a subcommand; an error is one line on stderr (naming what to fix) and exit status 1.
    --debug shows the traceback instead."""
    if getattr(args, "debug", False):
        return func(args)
    try:
        return func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the CLI's one place that turns any failure into a message
        from megatron_dppo.run.process import rank_prefix

        message = " ".join(str(e).split()) or type(e).__name__
        print(f"{rank_prefix()}error: {message}  ({type(e).__name__}; --debug shows the traceback)", file=sys.stderr)
        return 1


def build_parser() -> argparse.ArgumentParser:
    # Long because it is the subcommands' argparse declarations, one statement per flag.
    parser = argparse.ArgumentParser(prog="megatron-dppo", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="DPPO/GRPO training (the main job); under torchrun for several processes")
    t.add_argument("--config", required=True, help="YAML config (see examples/)")
    t.add_argument("--resume", action="store_true", help="continue from the run's latest checkpoint")
    t.add_argument(
        "--overwrite",
        action="store_true",
        help="delete an existing run dir of the same trainer.run_name and start again",
    )
    t.add_argument("--debug", action="store_true", help="on an error, show the full traceback")
    t.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.max_steps=5 pruning.r_q=0.5")
    t.set_defaults(func=_train)

    e = sub.add_parser(
        "evaluate",
        help="score a model on the validation sets (eval.sets, data.eval) without training: avg@n, pass@k, maj@n",
    )
    e.add_argument("--config", required=True, help="YAML config (the training config works as it is)")
    e.add_argument(
        "--checkpoint",
        help="a Megatron checkpoint (a run's step_* dir, its checkpoints/ root, or a converted one) instead of "
        "model.hf_dir",
    )
    e.add_argument("--out-dir", help="where answers and metrics go (default <output_dir>/<run_name>-evaluate)")
    e.add_argument("--debug", action="store_true", help="on an error, show the full traceback")
    e.add_argument("overrides", nargs="*", help="dotted overrides, e.g. eval.n=8 eval.temperature=1.0")
    e.set_defaults(func=_evaluate)

    sub.add_parser(
        "plan",
        help="per-GPU memory plan of a config; refuses layouts that cannot fit "
        "(megatron-dppo plan --config FILE [overrides] [--json])",
    )

    v = sub.add_parser("verify-unbiased", help="Monte Carlo check: pruned+reweighted gradient vs full batch")
    v.add_argument(
        "--strategy",
        action="append",
        help="pruning strategy, a name of algorithms/pruning.STRATEGIES (repeatable; default dppo)",
    )
    v.add_argument(
        "--loss-agg",
        action="append",
        choices=get_args(LossAgg),
        help="loss aggregation (repeatable; default seq-mean-token-mean)",
    )
    v.add_argument("--all-aggs", action="store_true", help="check every loss aggregation")
    v.add_argument("--num-prompts", "-B", type=_at_least(2), default=16)
    v.add_argument("--group-size", "-G", type=_at_least(2), default=8)
    v.add_argument("--r-q", type=float, default=0.5, help="prompt pruning ratio")
    v.add_argument("--r-o", type=float, default=0.5, help="completion pruning ratio")
    v.add_argument("--advantage", choices=get_args(AdvantageKind), default="grpo")
    v.add_argument(
        "--ratio-type", choices=get_args(RatioType), default="token", help="token: GRPO/DAPO ratio; sequence: GSPO"
    )
    v.add_argument("--kl-coef", type=_at_least(0.0, float), default=0.0)
    v.add_argument("--draws", type=_at_least(2), default=4000, help="Monte Carlo mask draws")
    v.add_argument("--seed", type=int, default=0)
    v.add_argument(
        "--dynamic-sampling",
        action="store_true",
        help="DAPO + pruning: refill rounds by weight against unpruned DAPO on a synthetic stream",
    )
    v.add_argument(
        "--max-resample-rounds", type=_at_least(0), default=3, help="dynamic sampling: rounds after the first"
    )
    v.add_argument(
        "--refill-by",
        choices=["weight", "count"],
        default="weight",
        help="dynamic sampling: 'count' is the old double-counting rule (a negative control)",
    )
    v.add_argument(
        "--fixed-order",
        action="store_true",
        help="dynamic sampling: keep one stream order instead of shuffling it per draw",
    )
    v.add_argument(
        "--method",
        action="append",
        help="a method of docs/methods.md (bppo, reco, adaprefix, ssopd, or all; repeatable): biased by design "
        "against GRPO, and DPPO checked for the method's own full-batch loss",
    )
    v.add_argument(
        "--overlong-filter",
        action="store_true",
        help="DAPO's overlong filter: completions that hit the length budget get no loss (both sides)",
    )
    v.add_argument(
        "--without-prompt-weight",
        action="store_true",
        help="negative control: the kept prompts train without their weight w_q (must report BIASED, exit 1)",
    )
    v.add_argument(
        "--rollout-correction",
        choices=get_args(RolloutCorrection),
        default="none",
        help="algorithm.rollout_correction: first its exact check on a toy policy (every kind's bias against the "
        "on-policy gradient and its bound), then pruning's Monte Carlo check sampling from the rollout policy, "
        "with the correction on every token, against the on-policy gradient",
    )
    v.add_argument(
        "--rollout-correction-cap",
        type=_at_least(1.0, float),
        default=None,
        help="algorithm.rollout_correction_cap C of the checked kinds (default: the config's, 2; inf: untruncated, "
        "where the product seq_tis is exact at any staleness and the Monte Carlo check is a z-test)",
    )
    v.add_argument(
        "--staleness",
        type=_at_least(0),
        default=0,
        help="trainer.max_staleness K: the rollout sampled with the weights K updates before pi_old (1 = before "
        "the last update; the exact table with that rollout policy, then pruning's Monte Carlo check sampling "
        "from it)",
    )
    v.add_argument(
        "--partial",
        action="store_true",
        help="partial rollouts (needs --staleness >= 1): each completion sampled by the weights K updates old up "
        "to a switch point and by the next version after it, each token's rollout log-prob its own sampler's",
    )
    v.add_argument(
        "--negative-control",
        choices=["none", "inverted", "one", "stale", "partial-one-policy"],
        default="none",
        help="a self-test of the rollout-correction check (must report BIASED and exit 1): feed it wrong "
        "inputs, rho inverted (mu / pi_old), rho = 1 (no reweighting while claiming one), stale (sampled by "
        "the weights one version older than the ones rho is computed against), or partial-one-policy (with "
        "--partial: every token's rollout log-prob recorded as the newer version's)",
    )
    v.set_defaults(func=_verify_unbiased)
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["plan"]:  # the planner owns its arguments (config + dotted overrides)
        from megatron_dppo.jobs.plan import plan_main

        return plan_main(argv[1:])
    args = build_parser().parse_args(argv)
    status = _run_reporting_errors(args.func, args)
    if _SKIP_FINALIZATION:  # what the process started is closed; leave without the interpreter's teardown
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


# A process of a run with dedicated rollout ranks closes what it started itself (engine, reward
# workers, logger, process groups and the bridge); the interpreter's teardown after that only printed
# nanobind's reference-leak reports about the Triton bindings (on training rank 0, 40 lines).
_SKIP_FINALIZATION = False


if __name__ == "__main__":
    sys.exit(main())
