import os
import pathlib

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

# The first call of each kernel compiles it: no deadline. CI gets a few more examples.
settings.register_profile(
    "default", deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow]
)
# CI explores a fixed (derandomized) set of examples, so a run is reproducible; local runs
# draw new examples each time.
settings.register_profile(
    "ci",
    deadline=None,
    max_examples=80,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("ci" if os.environ.get("CI") else "default")


@pytest.fixture
def rng():
    return np.random.default_rng(20250713)


# Test tiers: markers by path, so that test files need no marks of their own. The fast tier is
# ``pytest -m "not slow and not examples and not docs"`` (CONTRIBUTING.md); CI runs everything.
_ROOT = pathlib.Path(__file__).resolve().parent.parent
_TIERS = {
    "tests/test_examples.py": ("examples",),
    "tests/test_docs.py": ("docs",),
    "docs/": ("docs",),
    "tests/test_benchmarks.py": ("benchmarks", "slow"),
    "tests/gpu/simulator/": ("gpu", "gpu_sim", "slow"),
    "tests/gpu/": ("gpu", "slow"),
}


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(items):
    for item in items:
        try:
            path = item.path.resolve().relative_to(_ROOT).as_posix()
        except ValueError:  # outside the repository
            continue
        for prefix, markers in _TIERS.items():
            if path == prefix or (prefix.endswith("/") and path.startswith(prefix)):
                for marker in markers:
                    item.add_marker(marker)
                break
