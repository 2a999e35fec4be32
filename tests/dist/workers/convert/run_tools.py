"""Worker: several runs of the conversion tools in ONE process (each Python start costs ~10 s of CPU).

    python run_tools.py PLAN.json OUT.json                        # conversions
    torchrun --nproc_per_node 2 run_tools.py PLAN.json OUT.json   # --verify-only runs (any 2-rank layout)

PLAN.json: [[name, tool.py, [arg, ...]], ...], run in order through each tool's own main(argv),
what `python tool.py ARGS` runs. OUT.json (OUT.rank<r>.json under torchrun): {name: {"status":
main's return value, "stdout": ..., "stderr": ...}}; each run's output is echoed to this process's
stdout too. Under torchrun a tool's --verify-only verifies in this process (its main sees RANK) at
the run's --tp/--pp: the world is kept between runs (destroy_parallel(world=False)) and each run
sets up its own layout on it; TP=1 x PP=1 on 2 ranks is DP=2.
"""

import contextlib
import functools
import io
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))  # tests/: shared_helpers
from shared_helpers import load_tool  # noqa: E402


def main():
    plan_path, out_path = sys.argv[1:3]
    import megatron_dppo.megatron as mg

    # The verify of tools/convert_hf_to_megatron.py tears the world down after its check: keep it.
    destroy = mg.destroy_parallel
    mg.destroy_parallel = functools.partial(destroy, world=False)
    tools, results = {}, {}
    with open(plan_path) as f:
        plan = json.load(f)
    for name, tool, argv in plan:
        if tool not in tools:
            tools[tool] = load_tool(tool)
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = tools[tool].main([str(a) for a in argv])
        results[name] = {"status": status, "stdout": out.getvalue(), "stderr": err.getvalue()}
        print(f"== {name}: {os.path.basename(tool)} {' '.join(map(str, argv))} -> {status}", flush=True)
        print(out.getvalue() + err.getvalue(), flush=True)
    import torch.distributed as dist

    if dist.is_initialized():
        out_path = out_path.replace(".json", f".rank{dist.get_rank()}.json")
        destroy()
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
