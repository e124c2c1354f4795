"""Repository-level pytest set-up, loaded before anything imports numba.

Tests keep numba's cache in the repository (``.numba_cache``, ignored by git) unless
``NUMBA_CACHE_DIR`` is set, as CI does. softorder keys its own subdirectory by a hash of all
kernel sources (:func:`softorder.core.cache_dir`), so editing ``softorder/core`` never runs
stale compiled code. Subprocesses started by tests inherit the variable and reuse the cache.
"""

import os
import pathlib

_ROOT = pathlib.Path(__file__).parent
os.environ.setdefault("NUMBA_CACHE_DIR", str(_ROOT / ".numba_cache"))
