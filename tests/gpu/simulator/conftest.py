"""GPU kernels in numba's CUDA simulator, against the CPU kernels.

Collected only in their own pytest invocation with ``NUMBA_ENABLE_CUDASIM=1`` (set before
numba is imported; the simulator and real PTX compilation cannot share one process):

    NUMBA_ENABLE_CUDASIM=1 python -m pytest tests/gpu/simulator

Blocks are made tiny (4 threads x 2 elements) so that every row spans several blocks and the
scans' carries between tiles are exercised.
"""

import os

import pytest

if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
    collect_ignore_glob = ["test_*.py"]
else:

    def pytest_collection_modifyitems(items):
        # The simulator runs kernels on NumPy scalars, which warn where a GPU does not:
        # offset_z's deliberate inf - inf (checked for NaN right after).
        for item in items:
            item.add_marker(
                pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
            )

    @pytest.fixture(autouse=True)
    def _tiny_blocks():
        from softorder.core.cuda import _launch

        previous = _launch.configure(threads=4, items=2)
        yield
        _launch.configure(**previous)
