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
MACHINE = {"started", "code", "loadavg"}


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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("old", help="a compare_methods.py JSON")
    p.add_argument("new", help="another, of the same methods and seeds")
    args = p.parse_args(argv)
    old, new = (json.load(open(path)) for path in (args.old, args.new))
    found = differences(old, new)
    for line in found[:50]:
        print(line)
    print(
        f"{len(old['runs'])} runs of {old['code_versions']} against {len(new['runs'])} of {new['code_versions']}: "
        f"{len(found)} differing fields (times excluded)"
    )
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
