"""tools/plan_measure.py --states --quick: the plan's state rows equal a real MegatronPolicy's tensor bytes."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_states_equal_megatron_tensor_bytes():
    """The weights / fp32 grad buffer / optimizer rows equal a real MegatronPolicy's tensor bytes
    (bf16 + fp32 master, untied). tools/plan_measure.py runs the fuller comparison."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "plan_measure.py"), "--states", "--quick"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count(" ok") == 3
