import os

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
