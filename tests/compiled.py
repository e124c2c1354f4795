"""What numba has compiled so far, for tests that check a path compiles nothing new."""

from __future__ import annotations


def read_only_signatures() -> set:
    """Every (kernel, signature) compiled so far that takes a read-only array: numba types
    read-only arrays apart, so each such signature is a whole kernel compiled a second time.
    """
    from numba import types

    from softorder import core

    found = set()
    for name in core._KERNELS:
        for signature in getattr(core, name).serial.signatures:
            if any(isinstance(t, types.Array) and not t.mutable for t in signature):
                found.add((name, signature))
    return found
