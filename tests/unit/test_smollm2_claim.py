"""tools/smollm2_claim.py without training: the train set it sizes, the CPU seconds it gives each
step from its samples, the claim it computes from synthetic runs (reached, not reached with the gap,
a DPPO run that pruned nothing, partial), the files of its report, and what it starts, skips and
continues for runs in every state on disk (the launch is a fake). The real runs end to end, on the
tiny model: tests/e2e/test_smollm2_claim.py."""

import argparse
import json
import math
from pathlib import Path

import pytest
from shared_helpers import load_tool

from megatron_dppo.run.run_dir import write_marker

claim_tool = load_tool("smollm2_claim")
TINY = "examples/tiny/addition.yaml"


# ---------------------------------------------------------------------------------------------
# Synthetic runs: metrics rows and the ledger of CPU samples a ClaimJob would have written


def rows_and_ledger(accs, step_s=10.0, eval_s=5.0, cpu_per_wall=0.8, kept=0.75, drawn=16):
    """Step 0's evaluation, then one row per step; samples whose interval (step + its
    evaluation) burns cpu_per_wall CPU seconds per wall second."""
    rows = [{"step": 0, "eval/accuracy": accs[0]}]
    marks, cpu, wall = [[0, 30.0, 1000.0]], 30.0, 1000.0
    for step, acc in enumerate(accs[1:], start=1):
        rows.append(
            {
                "step": step,
                "time/step": step_s,
                "time/eval": eval_s,
                "eval/accuracy": acc,
                "prune/prompts_kept_frac": 1.0 if step == 1 else kept,
                "rollout/prompts_drawn": drawn,
            }
        )
        wall += step_s + eval_s
        cpu += cpu_per_wall * (step_s + eval_s)
        marks.append([step, cpu, wall])
    return rows, {"segments": [{"state": "fresh", "marks": marks}]}


def summary(method, seed, accs, **kw):
    run = argparse.Namespace(name=f"{method}-s{seed}", method=method, seed=seed)
    rows, ledger = rows_and_ledger(accs, **kw)
    return claim_tool.summarize(run, rows, ledger, max_steps=len(accs) - 1)


GRPO_ACCS = [0.1, 0.3, 0.5, 0.6, 0.6]  # reaches its final 0.6 at step 3
DPPO_ACCS = [0.1, 0.4, 0.6, 0.6, 0.6]  # reaches it at step 2, at half GRPO's CPU a step


def offset(accs, d):
    return [a + d for a in accs]


def grpo_runs():
    return [summary("grpo", s, offset(GRPO_ACCS, d), kept=1.0) for s, d in enumerate((-0.02, 0.0, 0.02))]


# ---------------------------------------------------------------------------------------------
# The plan


def test_train_size_makes_every_prompt_come_back():
    assert claim_tool.train_size_for(16, 40, 3) == 208  # 13 steps an epoch
    assert 16 * 40 / 208 >= 3
    assert claim_tool.train_size_for(8, 2, 2) == 8
    with pytest.raises(ValueError, match="--visits must be >= 2"):
        claim_tool.train_size_for(16, 40, 1)
    with pytest.raises(ValueError, match="--steps 2 is too few for every prompt to be drawn --visits 3 times"):
        claim_tool.train_size_for(16, 2, 3)


def test_bad_options_are_one_line_errors_at_start_up(capsys):
    assert claim_tool.main(["--config", TINY, "--steps", "2", "--visits", "3", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: --steps 2 is too few for every prompt to be drawn --visits 3 times"
    assert claim_tool.main(["--config", "no/such.yaml", "--dry-run"]) == 2
    assert capsys.readouterr().err.strip() == "error: --config no/such.yaml: no such file"


def test_a_missing_model_is_named_before_any_run_starts(tmp_path, capsys):
    argv = ["--config", TINY, "--steps", "2", "--visits", "2", "--seeds", "1", "--out", str(tmp_path / "out")]
    assert claim_tool.main([*argv, "--override", "model.hf_dir=/no/such/model"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: model.hf_dir /no/such/model: no model there") and "build_smollm2.py" in err
    assert not list((tmp_path / "out").glob("*.log"))  # nothing started


def test_an_out_dir_of_someone_elses_files_is_refused_and_left_as_it_was(tmp_path, capsys):
    """--out must be new, empty or this script's (its mark): a directory holding a user's file is
    refused in one line before anything is written there; a new one gets the mark and is taken again."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("a user's file")
    argv = ["--config", TINY, "--steps", "2", "--visits", "2", "--seeds", "1", "--report"]
    assert claim_tool.main([*argv, "--out", str(mine)]) == 2
    assert "holds files this script did not write" in capsys.readouterr().err
    assert (
        sorted(p.name for p in mine.iterdir()) == ["notes.txt"] and (mine / "notes.txt").read_text() == "a user's file"
    )
    ours = tmp_path / "ours"
    claim_tool.claim_out_dir(ours)
    (ours / "grpo-s0.cpu.json").write_text("{}")
    claim_tool.claim_out_dir(ours)  # marked: taken again, whatever it holds
    with pytest.raises(ValueError, match="is not a directory"):
        claim_tool.claim_out_dir(mine / "notes.txt")


def test_plan_is_compare_methods_grpo_and_dppo_evaluated_every_step(tmp_path):
    args = claim_tool.build_parser().parse_args(["--config", TINY, "--seeds", "3", "--steps", "6", "--visits", "3"])
    runs = claim_tool.plan(args, tmp_path, train_size=64)
    assert [r.name for r in runs] == [
        "grpo-s0",
        "dppo-0.5-0.5-s0",
        "dppo-0.5-0.5-s1",
        "grpo-s1",
        "grpo-s2",
        "dppo-0.5-0.5-s2",
    ]
    dppo = runs[1].overrides
    for setting in ("pruning.strategy=dppo", "pruning.r_q=0.5", "pruning.r_o=0.5", "trainer.eval_every=1"):
        assert setting in dppo
    for setting in ("trainer.threads=1", "data.train_size=64", "eval.n=4", "trainer.max_steps=6", "trainer.seed=0"):
        assert setting in dppo and setting in runs[0].overrides
    assert "pruning.strategy=none" in runs[0].overrides and "pruning.strategy=dppo" not in runs[0].overrides


# ---------------------------------------------------------------------------------------------
# CPU seconds per step


def test_step_cpu_is_time_step_times_the_intervals_cpu_per_wall_second():
    rows, ledger = rows_and_ledger([0.1, 0.2, 0.3], step_s=10.0, eval_s=5.0, cpu_per_wall=0.8)
    assert claim_tool.step_train_cpu(rows, ledger) == {1: pytest.approx(8.0), 2: pytest.approx(8.0)}
    assert claim_tool.step_train_cpu(rows, {"segments": []}) is None


def test_a_resumed_process_first_sample_starts_no_interval():
    """Steps 1-2 by a first process at 0.5 CPU/wall; a resumed one restores step 2's row at its
    start-up, then steps 3-4 at 1.0: step 3's interval holds start-up, so it gets the run's mean."""
    rows = [{"step": s, "time/step": 10.0} for s in (1, 2, 3, 4)]
    first = {"state": "fresh", "marks": [[0, 0.0, 0.0], [1, 5.0, 10.0], [2, 10.0, 20.0]]}
    resumed = {"state": "resume", "marks": [[2, 40.0, 500.0], [3, 50.0, 510.0], [4, 60.0, 520.0]]}
    cpu = claim_tool.step_train_cpu(rows, {"segments": [first, resumed]})
    assert cpu[1] == pytest.approx(5.0) and cpu[2] == pytest.approx(5.0) and cpu[4] == pytest.approx(10.0)
    assert cpu[3] == pytest.approx(10.0 * (5.0 + 5.0 + 10.0) / 30.0)


# ---------------------------------------------------------------------------------------------
# The claim


def test_mean_and_standard_error_per_step():
    curve = claim_tool.mean_curve(grpo_runs())
    assert [p["step"] for p in curve] == [0, 1, 2, 3, 4]
    assert [p["acc"] for p in curve] == pytest.approx(GRPO_ACCS)
    assert curve[3]["acc_se"] == pytest.approx(0.02 / math.sqrt(3))  # sd 0.02 over 3 seeds
    assert [p["cpu_s"] for p in curve] == pytest.approx([0.0, 8.0, 16.0, 24.0, 32.0])


def test_dppo_reaching_grpos_final_accuracy_per_seed_and_on_the_mean():
    dppo = [
        summary("dppo-0.5-0.5", s, offset(DPPO_ACCS, d), step_s=5.0)
        for s, d in enumerate((0.0, 0.02, -0.02))  # seed 2 stays 2 points under
    ]
    c = claim_tool.claim(grpo_runs(), dppo, planned=6)
    assert c["target_acc"] == pytest.approx(0.6)
    assert c["grpo_reach"] == {"reached": True, "cpu_s": pytest.approx(24.0), "step": pytest.approx(3.0), "gap": None}
    # DPPO: 0.8 x 5 s = 4 CPU s a step; the mean curve reaches 0.6 at step 2.
    assert c["dppo_reach"]["cpu_s"] == pytest.approx(8.0) and c["dppo_reach"]["step"] == pytest.approx(2.0)
    seeds = {p["seed"]: p for p in c["dppo_reach_per_seed"]}
    assert seeds[0]["cpu_s"] == pytest.approx(8.0)
    assert seeds[1]["step"] == pytest.approx(1 + 0.18 / 0.2)  # 0.42 -> 0.62, interpolated
    assert seeds[2]["reached"] is False and seeds[2]["gap"] == pytest.approx(0.02)
    assert c["speedup_to_target_cpu"] == pytest.approx(3.0)
    assert c["speedup_at_equal_steps_cpu"] == pytest.approx(2.0)
    assert c["dppo"]["prompts_pruned_frac"] == pytest.approx(0.25 * 3 / 4)  # step 1 has no history
    assert c["verdict"] == "met: 3.00x"
    settings = {"train_size": 208, "visits": 3, "code_versions": ["abc1234"], "seeds": [0, 1, 2], "command": "x"}
    row = claim_tool.claim_row(c, settings, "claim.png")
    assert "DPPO: 8 s (step 2.0) of train CPU against GRPO's 24 s (step 3.0), 3.00x" in row


def test_dppo_that_never_reaches_it_reports_not_reached_with_the_gap():
    dppo = [summary("dppo-0.5-0.5", s, [0.1, 0.4, 0.5, 0.5, 0.5], step_s=5.0) for s in range(3)]
    c = claim_tool.claim(grpo_runs(), dppo, planned=6)
    assert c["dppo_reach"]["reached"] is False and c["dppo_reach"]["gap"] == pytest.approx(0.1)
    assert c["speedup_to_target_cpu"] is None
    assert c["verdict"] == "not met: DPPO does not reach GRPO's final accuracy (10.0 points short)"
    settings = {"train_size": 208, "visits": 3, "code_versions": ["abc1234"], "seeds": [0, 1, 2], "command": "x"}
    row = claim_tool.claim_row(c, settings, "claim.png")
    assert "DPPO: not reached (gap 10.0 points); GRPO reached it in " in row and "of train CPU" in row
    assert len(row.strip("|").split(" | ")) == 5  # claim | measured | runs | met | picture


def test_a_dppo_run_that_pruned_no_prompt_does_not_measure_the_claim():
    dppo = [summary("dppo-0.5-0.5", s, DPPO_ACCS, step_s=5.0, kept=1.0 if s == 1 else 0.75) for s in range(3)]
    c = claim_tool.claim(grpo_runs(), dppo, planned=6)
    assert c["dppo_runs_without_pruning"] == [1]
    assert c["verdict"] == "not measuring the claim: DPPO seed(s) [1] pruned no prompt"


def test_partial_and_too_few_seeds_are_said():
    dppo = [summary("dppo-0.5-0.5", 0, DPPO_ACCS, step_s=5.0)]
    assert claim_tool.claim(grpo_runs(), dppo, planned=6)["verdict"] == "partial: 4 of 6 runs finished"
    c = claim_tool.claim(grpo_runs()[1:2], dppo, planned=2)  # the seed without an offset
    assert c["verdict"] == "met: 3.00x; 1 seed(s), fewer than 3"


def test_report_writes_json_markdown_picture_and_the_claim_row(tmp_path):
    runs = []
    for method, accs, step_s in (("grpo", GRPO_ACCS, 10.0), ("dppo-0.5-0.5", DPPO_ACCS, 5.0)):
        run = argparse.Namespace(name=f"{method}-s0", method=method, seed=0, run_dir=tmp_path / f"{method}-s0")
        rows, ledger = rows_and_ledger(accs, step_s=step_s, kept=1.0 if method == "grpo" else 0.75)
        run.run_dir.mkdir()
        (run.run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        claim_tool.write_ledger(run, {**ledger, "overrides": []})
        runs.append(run)
    settings = {"config": TINY, "steps": 4, "visits": 3, "train_size": 8, "prompts_per_step": 8, "group_size": 4}
    settings |= {"eval_size": 16, "seeds": [0], "parallel": 2, "threads": 1, "command": ".venv/bin/python tools/x"}
    result = claim_tool.report(runs, tmp_path, 4, settings, png_copy=str(tmp_path / "docs" / "pic.png"))
    saved = json.loads((tmp_path / "claim.json").read_text())
    assert saved["claim"]["verdict"] == result["claim"]["verdict"] == "met: 3.00x; 1 seed(s), fewer than 3"
    assert saved["claim_row"].endswith("| [SmolLM2 claim](pic.png) |")
    assert (tmp_path / "claim.png").stat().st_size > 0 and (tmp_path / "docs" / "pic.png").stat().st_size > 0
    md = (tmp_path / "claim.md").read_text()
    assert "| 3 | 60.0% | 24 | 60.0% | 12 |" in md and saved["claim_row"] in md


# ---------------------------------------------------------------------------------------------
# Resumable: what it skips, continues and starts


def write_run(run_dir: Path, steps: int, checkpoint: bool, max_steps: int = 2):
    run_dir.mkdir(parents=True)
    write_marker(str(run_dir))
    rows = [{"step": s, "eval/accuracy": 0.5, **({"time/step": 1.0} if s else {})} for s in range(steps + 1)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if checkpoint:
        (run_dir / "checkpoints" / f"step_{steps:06d}").mkdir(parents=True)


class FakeJob:
    """What execute() needs of a ClaimJob; `fails` runs end without reaching max_steps."""

    def __init__(self, run, max_steps, fails):
        self.run, self.max_steps, self.fails = run, max_steps, fails

    def sample(self):
        pass

    def poll(self):
        return True

    def finish(self):
        if self.fails:
            return 1
        self.run.run_dir.mkdir(parents=True, exist_ok=True)
        rows = [{"step": s, "eval/accuracy": 0.5} for s in range(self.max_steps + 1)]
        (self.run.run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return 0

    def stop(self, grace_s):
        pass


def plan_four(tmp_path):
    args = claim_tool.build_parser().parse_args(["--config", TINY, "--seeds", "2", "--steps", "2", "--visits", "2"])
    return args, claim_tool.plan(args, tmp_path, train_size=8)


def test_done_runs_are_skipped_partial_ones_resumed_and_the_rest_started(tmp_path):
    args, runs = plan_four(tmp_path)
    by_name = {r.name: r for r in runs}
    write_run(by_name["grpo-s0"].run_dir, steps=2, checkpoint=True)  # done
    write_run(by_name["dppo-0.5-0.5-s0"].run_dir, steps=1, checkpoint=True)  # killed after a save
    write_run(by_name["dppo-0.5-0.5-s1"].run_dir, steps=1, checkpoint=False)  # killed before its first save
    # grpo-s1: never started
    states = {r.name: claim_tool.run_state(r, 2) for r in runs}
    assert states == {"grpo-s0": "done", "dppo-0.5-0.5-s0": "resume", "dppo-0.5-0.5-s1": "restart", "grpo-s1": "fresh"}
    commands = {n: claim_tool.train_command(TINY, by_name[n], s) for n, s in states.items() if s != "done"}
    assert commands["dppo-0.5-0.5-s0"][-1] == "--resume"
    assert commands["dppo-0.5-0.5-s1"][-1] == "--overwrite"  # the trainer deletes only a dir with its marker
    assert "--resume" not in commands["grpo-s1"] and "--overwrite" not in commands["grpo-s1"]

    started = []

    def start(run, config, threads, state):
        started.append((run.name, state, threads))
        return FakeJob(run, 2, fails=False)

    args.poll_s = 0
    assert claim_tool.execute(runs, TINY, 2, args, start=start, log=lambda m: None) == {"failed": []}
    assert started == [("dppo-0.5-0.5-s0", "resume", 1), ("dppo-0.5-0.5-s1", "restart", 1), ("grpo-s1", "fresh", 1)]
    assert {claim_tool.run_state(r, 2) for r in runs} == {"done"}
    started.clear()  # run again: everything is done, nothing starts
    claim_tool.execute(runs, TINY, 2, args, start=start, log=lambda m: None)
    assert started == []


def test_a_failed_run_is_continued_from_its_state_then_given_up(tmp_path):
    args, runs = plan_four(tmp_path)
    grpo = runs[:1]
    tries = []

    def start(run, config, threads, state):
        tries.append(state)
        if len(tries) == 1:  # the first process saved a checkpoint at step 1, then died
            write_run(run.run_dir, steps=1, checkpoint=True)
        return FakeJob(run, 2, fails=len(tries) < 3)

    args.poll_s, args.retries = 0, 2
    assert claim_tool.execute(grpo, TINY, 2, args, start=start, log=lambda m: None) == {"failed": []}
    assert tries == ["fresh", "resume", "resume"]
    tries.clear()
    args.retries = 0
    _, other = plan_four(tmp_path / "other")
    assert claim_tool.execute(other[:1], TINY, 2, args, start=start, log=lambda m: None) == {"failed": ["grpo-s0"]}


def test_a_run_dir_not_made_by_this_project_or_with_other_settings_is_refused(tmp_path):
    _, runs = plan_four(tmp_path)
    runs[0].run_dir.mkdir(parents=True)
    (runs[0].run_dir / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="grpo-s0: .* was not created by megatron-dppo"):
        claim_tool.run_state(runs[0], 2)
    write_run(runs[1].run_dir, steps=1, checkpoint=True)
    claim_tool.write_ledger(runs[1], {"overrides": [*runs[1].overrides[:-1], "eval.n=8"], "segments": []})
    with pytest.raises(ValueError, match=r"dppo-0.5-0.5-s0: .* was started with other settings \(then \['eval.n=8'\]"):
        claim_tool.check_same_settings(runs[1], claim_tool.run_state(runs[1], 2))
    claim_tool.check_same_settings(runs[1], "restart")  # no checkpoint to continue: it starts over anyway
