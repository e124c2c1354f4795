"""Repository-level pytest set-up, loaded before anything imports numba.

numba's on-disk cache is invalidated by the modification time of a kernel's own file only, not
of the helpers it inlines from other files, so after editing ``softorder/core`` a cached kernel
can run stale code. Tests therefore use a cache directory keyed by a hash of all core sources
(unless ``NUMBA_CACHE_DIR`` is set, as CI does).
"""

import hashlib
import os
import pathlib

_ROOT = pathlib.Path(__file__).parent
if "NUMBA_CACHE_DIR" not in os.environ:
    _sources = b"".join(p.read_bytes() for p in sorted((_ROOT / "softorder" / "core").glob("*.py")))
    _digest = hashlib.sha256(_sources).hexdigest()[:16]
    os.environ["NUMBA_CACHE_DIR"] = str(_ROOT / ".numba_cache" / _digest)
