"""Run a conversion tool that stalls midway, so a test can SIGKILL it at a known point.

    python stall_convert.py --stall MODULE:ATTR --after N --signal FILE TOOL.py TOOL-ARGS...

Wraps MODULE.ATTR (a function, or Class.method): the first N calls run normally, the next one
creates FILE and sleeps (the test then kills this process), so the tool has written part of its
output when it dies. Everything else is the real tool, in this process.
"""

import importlib
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))  # tests/: shared_helpers
from shared_helpers import load_tool  # noqa: E402


def main():
    args = sys.argv[1:]
    opts = {}
    while args and args[0].startswith("--"):
        opts[args[0][2:]] = args[1]
        args = args[2:]
    module_name, attr = opts["stall"].split(":")
    owner = importlib.import_module(module_name)
    *path, name = attr.split(".")
    for part in path:
        owner = getattr(owner, part)
    real, calls, after = getattr(owner, name), [0], int(opts["after"])

    def stalling(*a, **kw):
        calls[0] += 1
        if calls[0] > after:
            with open(opts["signal"], "w") as f:
                f.write(f"{calls[0] - 1} calls of {opts['stall']} done\n")
            time.sleep(600)
        return real(*a, **kw)

    setattr(owner, name, stalling)
    tool, tool_args = args[0], args[1:]
    sys.exit(load_tool(tool).main(tool_args))


if __name__ == "__main__":
    main()
