"""The garbage collector is paused while numba compiles (softorder.core._jit._pause_gc) and
restored, as it was, when the compilation ends."""

import gc

import numba
from numba.core import event

from softorder.core import _jit


class _Spy(event.Listener):
    def __init__(self):
        self.seen = []

    def on_start(self, ev):
        self.seen.append(gc.isenabled())

    def on_end(self, ev):
        pass


def test_the_collector_is_off_while_numba_compiles_and_restored_after():
    _jit._watch_compilation()  # (softorder's first kernel registers it; idempotent)
    spy = _Spy()
    event.register("numba:compile", spy)
    try:
        assert numba.njit(lambda x: x + 1)(1) == 2
        assert spy.seen and not any(spy.seen)
        assert gc.isenabled()
        gc.disable()  # a caller's choice is kept
        try:
            assert numba.njit(lambda x: x + 2)(1) == 3
            assert not gc.isenabled()
        finally:
            gc.enable()
        assert _jit._gc_paused[0] == 0
    finally:
        event.unregister("numba:compile", spy)
