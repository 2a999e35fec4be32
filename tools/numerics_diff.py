"""Two runs of tools/compare_methods.py (their JSONs), run by run: every field that is not a time
(tokens generated and trained, prompts and completions kept, pack density, optimizer steps, reward,
accuracy at every evaluation) must be equal. Says whether a later commit reproduces an earlier
table's numerics exactly, so that only its times need the machine's attention.

    .venv/bin/python tools/numerics_diff.py docs/results_longtail.json docs/results_longtail_7757a29.json
"""

import argparse
import json
import sys

# per-run fields that measure time or the machine, not what the code computed
TIMES = {"train_time_s", "phase_time_s", "median_step_s", "train_cpu_s", "eval_time_s", "process_wall_s"}
MACHINE = {"started", "code", "environment", "loadavg"}


def environments(result: dict) -> list[dict | None]:
    """The distinct environments (packages, processor: compare_methods.environment) of a JSON's
    runs; None for runs recorded before it was."""
    seen: list[dict | None] = []
    for run in result["runs"]:
        if run.get("environment") not in seen:
            seen.append(run.get("environment"))
    return seen


def differences(old: dict, new: dict) -> list[str]:
    by_key = {(r["method"], r["seed"]): r for r in new["runs"]}
    found = []
    for run in old["runs"]:
        key = (run["method"], run["seed"])
        if key not in by_key:
            found.append(f"{key[0]} seed {key[1]}: not in the second file")
            continue
        other = by_key[key]
        for field in sorted(set(run) - TIMES - MACHINE):
            a, b = run[field], other.get(field)
            if field == "curve":  # [step, train time, accuracy, cpu time]: compare step and accuracy
                a, b = ([(p[0], p[2]) for p in c] for c in (a, b or []))
            if a != b:
                found.append(f"{key[0]} seed {key[1]}: {field} {str(a)[:60]} != {str(b)[:60]}")
    return found


def differing_runs(old: dict, new: dict) -> list[tuple[str, int]]:
    """The (method, seed) runs of `old` with at least one differing field."""
    return sorted({(r["method"], r["seed"]) for r in old["runs"] if differences({"runs": [r]}, new)})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("old", help="a compare_methods.py JSON")
    p.add_argument("new", help="another, of the same methods and seeds")
    args = p.parse_args(argv)
    old, new = (json.load(open(path)) for path in (args.old, args.new))
    found = differences(old, new)
    for line in found[:50]:
        print(line)
    envs = {path: environments(data) for path, data in ((args.old, old), (args.new, new))}
    if any(None in e for e in envs.values()):
        print("environment: not recorded for every run (JSONs before compare_methods recorded it)")
    elif envs[args.old] != envs[args.new]:
        for path, e in envs.items():
            print(f"environment of {path}: {json.dumps(e)}")
    print(
        f"{len(old['runs'])} runs of {old['code_versions']} against {len(new['runs'])} of {new['code_versions']}: "
        f"{len(found)} differing fields (times excluded)"
        + (f" in {len(differing_runs(old, new))} runs" if found else "")
    )
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
