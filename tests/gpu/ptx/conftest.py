"""Real-GPU compilation without a GPU: not in the simulator's process (they cannot share one)."""

import os

if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    collect_ignore_glob = ["test_*.py"]
