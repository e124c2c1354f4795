"""The one place that holds the numba options of every kernel, where their on-disk cache lives,
and when they may run on numba's thread pool.

All kernels compute in float64 (README, "float32"), so each kernel compiles once.

Serial first, threads only when asked for. Every batched kernel has a serial variant
(``parallel=False``), compiled on its first call and used for small inputs and whenever
parallelism is off; the ``parallel=True`` variant is compiled lazily, the first time a large
batched call may use it. Serial calls never touch a threading runtime, so a process can fork
(``multiprocessing``, PyTorch's ``DataLoader``) after any number of them, and the child can
call softorder. After the parallel variant has started numba's thread pool:

* with GNU OpenMP (numba's ``omp`` layer, the default without TBB) a forked child cannot use
  that pool ("fork() called from a process already using GNU OpenMP"); softorder notices the
  fork and runs the child's calls serially;
* numba's ``workqueue`` layer aborts when two threads enter it at once; softorder lets one
  parallel call in at a time, and a call that finds the pool busy runs serially (two pools'
  worth of threads on the same cores would not be faster anyway).

So every threading layer works; none is forced on the process (numba picks it once per
process for all numba code, so it is the user's choice: ``NUMBA_THREADING_LAYER``).

Cache. ``cache=True`` would make numba write next to the sources (``softorder/core/
__pycache__``) when it can: inside an installed package that leaves files pip does not remove,
and a later ``pip install -e .`` then finds a ``softorder/core`` namespace package that shadows
the real one. The kernels are cached in :func:`cache_dir` instead, never inside the package.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import hashlib
import logging
import os
import pathlib
import sys
import threading

#: Below this many rows or elements a kernel runs on the calling thread alone. Waking the
#: thread pool costs more than it saves on small inputs, and on a busy machine (data loaders,
#: another process) OpenMP's barrier makes a short call's slow tail many times its median
#: (figures in CHANGELOG.md).
MIN_PARALLEL_ROWS = 2
MIN_PARALLEL_ELEMENTS = 32768

_OPTIONS = {"nogil": True, "error_model": "numpy", "fastmath": False}

_parallel = [True]
#: One parallel call at a time (the workqueue layer is not thread-safe); others run serially.
_pool_lock = threading.Lock()
#: Set in a child forked after the parent started a GNU OpenMP pool: the child runs serially.
_pool_unusable = [False]
_variant_lock = threading.Lock()

_log = logging.getLogger("softorder")


def set_parallel(enabled: bool) -> bool:
    """Let large batched calls run their rows on numba's thread pool (the default), or keep
    every kernel on the calling thread; returns the previous setting.

    The PyTorch and JAX bridges turn it off when imported: PyTorch's OpenMP threads and numba's
    spin against each other: with both pools active, calls of either library became several
    times slower (figures in CHANGELOG.md).

    Examples
    --------
    >>> from softorder import core
    >>> previous = core.set_parallel(False)
    >>> core.set_parallel(previous)
    False
    """
    previous = _parallel[0]
    _parallel[0] = bool(enabled)
    return previous


def _after_fork_in_child() -> None:
    # The thread pool's state is inherited by the child but not its threads. GNU OpenMP then
    # kills the child on its next parallel region; numba's workqueue and TBB layers recover.
    parallel = sys.modules.get("numba.np.ufunc.parallel")
    if parallel is not None and getattr(parallel, "_is_initialized", False):
        try:
            layer = parallel.threading_layer()
        except ValueError:
            return
        if layer == "omp":
            _pool_unusable[0] = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _source_hash() -> str:
    """Hash of every kernel source file, of the numba version and of the C library: numba
    invalidates a cached kernel when its own file changes, not when a helper it inlines from
    another file does; and whether kernels inline :mod:`softorder.core.fast_exp` for libm's
    ``exp`` depends on the C library, which numba's cache index does not record.
    """
    import platform

    import numba

    digest = hashlib.sha256(numba.__version__.encode())
    digest.update(repr(platform.libc_ver()).encode())
    core = pathlib.Path(__file__).parent
    for path in sorted(core.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def _user_cache_root() -> pathlib.Path:
    if sys.platform == "win32":
        base = os.environ.get("LOCALAPPDATA") or pathlib.Path.home() / "AppData" / "Local"
        return pathlib.Path(base) / "softorder" / "Cache"
    if sys.platform == "darwin":
        return pathlib.Path.home() / "Library" / "Caches" / "softorder"
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "softorder"


def _writable(path: pathlib.Path) -> bool:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".probe-{os.getpid()}-{threading.get_ident()}"
        probe.write_bytes(b"")
        probe.unlink()
        return True
    except OSError:
        return False


@functools.cache
def cache_dir() -> str | None:
    """The directory that holds softorder's compiled kernels, or ``None`` (no disk cache).

    ``$NUMBA_CACHE_DIR/softorder-<hash>`` when ``NUMBA_CACHE_DIR`` is set, else the user's
    cache directory (``~/.cache/softorder/numba-<hash>`` on Linux, ``$XDG_CACHE_HOME`` if set;
    ``~/Library/Caches/softorder`` on macOS; ``%LOCALAPPDATA%/softorder/Cache`` on Windows),
    else a directory in the system's temporary directory. ``<hash>`` covers the kernel sources
    and the numba version, so an upgrade or an edit never runs stale compiled code. It is never
    inside the installed package.

    Examples
    --------
    >>> import pathlib, softorder
    >>> from softorder.core._jit import cache_dir
    >>> package = pathlib.Path(softorder.__file__).parent
    >>> cache_dir() is None or package not in pathlib.Path(cache_dir()).parents
    True
    """
    import numba

    key = _source_hash()
    candidates = []
    if numba.config.CACHE_DIR:
        candidates.append(pathlib.Path(numba.config.CACHE_DIR) / f"softorder-{key}")
    else:
        try:
            candidates.append(_user_cache_root() / f"numba-{key}")
        except RuntimeError:  # no home directory
            pass
        import tempfile

        user = os.environ.get("USER") or os.environ.get("USERNAME") or "user"
        candidates.append(pathlib.Path(tempfile.gettempdir()) / f"softorder-{user}" / key)
    for path in candidates:
        if _writable(path):
            return str(path)
    return None


@functools.cache
def cache_classes():
    """The per-function numba cache with softorder's locator (``variant``: a subdirectory, so
    that the serial and parallel variants of one function never share entries: numba's index
    key has the signature, not the ``parallel`` flag).
    """
    from numba.core import caching

    def make(variant: str):
        class Locator(caching._SourceFileBackedLocatorMixin, caching._CacheLocator):
            def __init__(self, py_func, py_file):
                self._py_file = py_file
                self._lineno = py_func.__code__.co_firstlineno
                module = py_func.__module__.rsplit(".", 1)[-1]
                self._cache_path = os.path.join(cache_dir(), variant, module)

            def ensure_cache_path(self):
                os.makedirs(self._cache_path, exist_ok=True)

            def get_cache_path(self):
                return self._cache_path

            @classmethod
            def from_function(cls, py_func, py_file):
                if cache_dir() is None or not os.path.exists(py_file):
                    return None
                return cls(py_func, py_file)

        class Impl(caching.CompileResultCacheImpl):
            _locator_classes = [Locator]

        class FunctionCache(caching.FunctionCache):
            _impl_class = Impl

        return FunctionCache

    return {"serial": make("serial"), "parallel": make("parallel")}


def _jit(fn, variant: str = "serial", **options):
    import numba

    dispatcher = numba.njit(**_OPTIONS, **options)(fn)
    if not isinstance(dispatcher, numba.core.dispatcher.Dispatcher):
        return dispatcher  # NUMBA_DISABLE_JIT: the Python function itself
    if cache_dir() is not None:
        dispatcher._cache = cache_classes()[variant](fn)  # what cache=True does, relocated
    _watch_compilation()
    return dispatcher


def load_cached(dispatcher, arg_types: tuple) -> bool:
    """Whether ``dispatcher`` has code for the argument types ``arg_types`` without compiling:
    compiled in this process already, or loaded now from the disk cache. What numba's
    ``Dispatcher.compile`` does before it compiles (under numba's compiler lock, so a thread
    that compiles the same signature meanwhile is waited for), without the compilation: a
    caller that has another way to do its work can leave the compilation for later.

    Examples
    --------
    >>> import numpy as np
    >>> from numba import typeof
    >>> from softorder import core
    >>> from softorder.core._jit import load_cached
    >>> row, order = np.zeros((1, 3)), np.zeros((1, 3), np.int32)
    >>> core.take_rows(row, order, row)  # compiled, or loaded from the disk cache
    >>> load_cached(core.take_rows.serial, (typeof(row), typeof(order), typeof(row)))
    True
    """
    if not hasattr(dispatcher, "overloads"):  # NUMBA_DISABLE_JIT: the Python function
        return True
    arg_types = tuple(arg_types)
    if arg_types in dispatcher.overloads:
        return True
    from numba.core.compiler_lock import global_compiler_lock

    with global_compiler_lock, dispatcher._compiling_counter:
        if arg_types in dispatcher.overloads:
            return True
        compiled = dispatcher._cache.load_overload(arg_types, dispatcher.targetctx)
        if compiled is None:
            return False
        dispatcher._cache_hits[arg_types] += 1
        if not compiled.objectmode:
            dispatcher.targetctx.insert_user_function(
                compiled.entry_point, compiled.fndesc, [compiled.library]
            )
        dispatcher.add_overload(compiled)
        return True


def _unliteral_calls(dispatcher) -> None:
    """Type calls from compiled code with non-literal argument types: numba otherwise compiles
    one copy of a helper per literal value (``row_tables(..., True, ...)`` and ``(..., False,
    ...)``), which lengthens the first call (CHANGELOG.md).
    """
    from numba.core import types

    original = dispatcher.get_call_template

    def get_call_template(args, kws):
        args = tuple(types.unliteral(a) for a in args)
        kws = {k: types.unliteral(v) for k, v in kws.items()}
        return original(args, kws)

    dispatcher.get_call_template = get_call_template


#: Helpers are only called from compiled code: no wrappers for calls from Python or C, whose
#: compilation would only lengthen the first call (figures in CHANGELOG.md).
_INTERNAL = {"no_cpython_wrapper": True, "no_cfunc_wrapper": True}


def helper(fn):
    """Compile a per-row or scalar helper that kernels call (no parallelism of its own); it
    cannot be called from Python (its ``py_func`` can).

    Helpers write the minimum or maximum of two scalars as a conditional expression
    (``b if b < a else a``, which is what numba's ``min(a, b)`` computes, NaN included):
    numba compiles the builtins ``min``, ``max`` and ``int`` as functions of their own, one
    per combination of argument types, each compiled on a first call.
    """
    dispatcher = _jit(fn, **_INTERNAL)
    if hasattr(dispatcher, "get_call_template"):
        _unliteral_calls(dispatcher)
    return dispatcher


def address_only(dispatcher):
    """Refuse compiled code's direct calls of a helper that makes :class:`SymbolCalls`: its
    callers reach it through :class:`SymbolCalls`, which loads it
    (and register its symbols) themselves. A caller that linked it in would lose those
    symbols when the helper came from the disk cache (see :class:`SymbolCalls`).
    """
    if not hasattr(dispatcher, "get_call_template"):
        return dispatcher  # NUMBA_DISABLE_JIT
    from numba.core import errors

    name = dispatcher.py_func.__name__

    def get_call_template(args, kws):
        raise errors.TypingError(f"softorder: {name} is called through SymbolCalls only")

    dispatcher.get_call_template = get_call_template
    return dispatcher


def inner_helper(fn):
    """Compile a small helper called once per element with array arguments, inlined into its
    callers: a call that passes arrays costs their reference counting, which made
    ``target_sums`` several times slower called than written in place (CHANGELOG.md).
    """
    return _jit(fn, inline="always", **_INTERNAL)


#: Kernel dispatchers (serial and parallel), for the first-compilation note.
_kernels: set = set()
_noted = [False]
_watching = [False]


#: [depth of nested holds of numba's compiler lock, whether the collector was enabled before]
_gc_paused = [0, False]


def _pause_gc(step: int) -> None:
    """Keep Python's cyclic garbage collector off while numba holds its compiler lock (``step``
    +1 when the lock is taken, -1 when it is released; the lock is re-entrant, so holds nest).

    numba's typing, lowering and cache loading allocate millions of objects, which trigger
    full collections that walk every object of the process: next to PyTorch's modules that is
    about a tenth of a first call with an empty cache, and more of one with a warm cache. The
    collector is restored when the outermost hold ends (one thread holds the lock at a time),
    and collects then what the compilation left. Any numba compilation in the process counts,
    a user's own numba functions included.
    """
    if step > 0:
        if _gc_paused[0] == 0:
            _gc_paused[1] = gc.isenabled()
            gc.disable()
        _gc_paused[0] += 1
    elif _gc_paused[0] > 0:  # (0: a hold that began before the listener was added)
        _gc_paused[0] -= 1
        if _gc_paused[0] == 0 and _gc_paused[1]:
            gc.enable()


def _watch_compilation() -> None:
    """Say once per process, when a kernel starts compiling, that it takes seconds: a silent
    first call reads as a hang; and pause the garbage collector while numba compiles
    (:func:`_pause_gc`).
    """
    if _watching[0]:
        return
    _watching[0] = True
    from numba.core import event

    class Note(event.Listener):
        def on_start(self, ev):
            if not _noted[0] and id(ev.data["dispatcher"]) in _kernels:
                _noted[0] = True
                _log.warning(
                    "softorder: compiling numba kernels on first use (seconds, once: cached in "
                    "%s); softorder.precompile() compiles all of them ahead",
                    cache_dir(),
                )

        def on_end(self, ev):
            pass

    class PauseCollector(event.Listener):
        def on_start(self, ev):
            _pause_gc(+1)

        def on_end(self, ev):
            _pause_gc(-1)

    event.register("numba:compile", Note())
    event.register("numba:compiler_lock", PauseCollector())


def _emit_call(context, builder, callee, restype, arg_types, args, packed):
    """Emit a call of a compiled helper ``callee`` (numba's calling convention) with the
    arguments ``packed`` in a star-args tuple of types ``args``, cast to ``arg_types``; an
    exception the helper raised propagates to the caller.
    """
    from numba.core import cgutils, types

    values = [
        value if isinstance(actual, types.Array) else context.cast(builder, value, actual, wanted)
        for value, actual, wanted in zip(
            cgutils.unpack_tuple(builder, packed, len(args)), args, arg_types, strict=True
        )
    ]
    status, out = context.call_conv.call_function(builder, callee, restype, arg_types, values)
    with cgutils.if_unlikely(builder, status.is_error):
        context.call_conv.return_status_propagate(builder, status)
    return out


def _native_address(dispatcher, arg_types) -> int:
    if not hasattr(dispatcher, "overloads"):  # NUMBA_DISABLE_JIT: called as Python
        return 0
    dispatcher.compile(arg_types)
    compiled = dispatcher.overloads[arg_types]
    address = compiled.library.get_pointer_to_function(compiled.fndesc.llvm_func_name)
    if not address:
        raise RuntimeError(f"softorder: no compiled code for {dispatcher.py_func.__name__}")
    return address


class SymbolCalls:
    """Per-row helpers that kernels call by symbol, so that they are compiled once, not again
    inside each kernel: numba links every helper that a kernel calls into the kernel, where
    LLVM optimises and compiles it once more, on every first call with an empty cache; a
    helper called once per row with O(n) work gains nothing from that.

    Each helper's address is registered with LLVM under a symbol of its own
    (:func:`llvmlite.binding.add_symbol`), which the kernel's code declares and the JIT linker
    resolves; the compiled (and cached) code holds the symbol, never an address. A kernel's
    compilation registers the symbols it calls while typing the calls, and a kernel loaded
    from the disk cache registers them first: the calls add a function that does to the
    ``reload_init`` of the kernel's compiled result, which numba runs before it loads the
    code. Numba does not carry those functions from a callee loaded from the cache into a
    caller that links it, so only kernels, which no compiled code calls, and helpers marked
    :func:`address_only` make these calls.

    ``SymbolCalls(name=(dispatcher, argument types), ...)``; in a kernel,
    ``calls.name(*args)`` calls the helper, for exactly those argument types (read-only
    arrays pass as writable ones; other types are a typing error naming softorder).
    """

    def __init__(self, **helpers):
        self._helpers = helpers
        self._callers = {}
        for dispatcher, arg_types in helpers.values():
            if hasattr(dispatcher, "overloads"):
                _registry[_symbol(dispatcher, arg_types)] = (dispatcher, arg_types)

    def __getattr__(self, name):
        if name.startswith("_") or name not in self._helpers:
            raise AttributeError(name)
        if name not in self._callers:
            self._callers[name] = _symbol_caller(*self._helpers[name])
        return self._callers[name]


#: symbol -> (dispatcher, argument types) of every :class:`SymbolCalls` helper
_registry: dict = {}
#: symbol -> address, for the symbols registered with LLVM in this process
_symbols: dict = {}
#: symbol -> the function that registers it, in the ``reload_init`` of the kernels calling it
_relinkers: dict = {}


def _symbol(dispatcher, arg_types) -> str:
    """The symbol of a helper compiled for ``arg_types``: named after the helper, with a hash
    of the types (one helper may be linked for several). Never numba's ``_ZN5numba`` prefix,
    which numba requires to be defined in the same library.
    """
    fn = dispatcher.py_func
    key = hashlib.sha256(repr(tuple(arg_types)).encode()).hexdigest()[:12]
    return f"softorder_{fn.__module__.replace('.', '_')}_{fn.__name__}_{key}"


def link_symbol(dispatcher, arg_types) -> str:
    """Compile (or load) the helper and register its symbol, once per process."""
    symbol = _symbol(dispatcher, arg_types)
    if symbol not in _symbols:
        import llvmlite.binding

        address = _native_address(dispatcher, arg_types)
        llvmlite.binding.add_symbol(symbol, address)
        _symbols[symbol] = address
    return symbol


def _relink(symbol: str) -> None:
    """Register ``symbol`` before a kernel that calls it is loaded from the disk cache."""
    if symbol not in _registry:
        raise RuntimeError(f"softorder: no helper is known for the symbol {symbol}")
    link_symbol(*_registry[symbol])


def _accepted(given, wanted) -> bool:
    """Whether a helper compiled for ``wanted`` takes an argument of type ``given``: read-only
    arrays (the JAX bridge's residuals) have the writable arrays' data model, and kernels never
    write their inputs.
    """
    from numba.core import types

    given = types.unliteral(given)
    if isinstance(given, types.Array) and not given.mutable:
        given = given.copy(readonly=False)
    return given == wanted


def _symbol_caller(dispatcher, arg_types):
    """An intrinsic ``call(*args)``: the helper through its symbol (:class:`SymbolCalls`), with
    numba's calling convention (NUMBA_DISABLE_JIT: the helper's Python function).
    """
    import numba

    if not isinstance(dispatcher, numba.core.dispatcher.Dispatcher):

        def call(*args):
            return dispatcher(*args)

        return call

    from numba.core import cgutils, errors, types

    name = dispatcher.py_func.__name__

    @numba.extending.intrinsic
    def call(typingctx, *args):
        if len(args) != len(arg_types) or not all(map(_accepted, args, arg_types)):
            raise errors.TypingError(f"softorder: {name} is called with {arg_types}; got {args}")
        symbol = link_symbol(dispatcher, arg_types)
        restype = dispatcher.overloads[arg_types].signature.return_type

        def codegen(context, builder, signature, llargs):
            fnty = context.call_conv.get_function_type(restype, arg_types)
            callee = cgutils.get_or_insert_function(builder.module, fnty, symbol)
            out = _emit_call(context, builder, callee, restype, arg_types, args, llargs[0])
            if symbol not in _relinkers:
                _relinkers[symbol] = functools.partial(_relink, symbol)
            context.active_code_library._reload_init.add(_relinkers[symbol])
            return out

        return restype(types.StarArgTuple.from_types(args)), codegen

    return call


class CallOnDemand:
    """A helper that kernels call through a word of memory, which holds the helper's address
    once it is compiled (:meth:`link`) and 0 until then: a kernel compiles the call alone, not
    the helper, which a process compiles only when a row first needs it (a pullback's rare
    path). In a kernel, ``linked, out = on_demand.call(*args)``: with the word still 0,
    ``linked`` is false and ``out`` zeros, and the kernel hands its row back to its host, which
    links the helper and runs the row again.

    Each signature's word is registered with LLVM under a symbol of its own when this object is
    made (before any kernel that reads it can be compiled or loaded), so compiled and cached
    code holds the symbol, never an address.

    ``CallOnDemand(dispatcher, restype, key=argument types, ...)``: the helper's return type,
    declared, since a kernel is compiled before the helper (:meth:`link` checks it), and its
    signatures by key (e.g. the dtype of the row it reads).
    """

    def __init__(self, dispatcher, restype, **signatures):
        self._dispatcher = dispatcher
        self._restype = restype
        self._signatures = signatures
        self._lock = threading.Lock()
        self._words = {key: ctypes.c_int64(0) for key in signatures}
        self._jitted = hasattr(dispatcher, "overloads")
        if self._jitted:
            import llvmlite.binding

            self._slots = {
                key: _symbol(dispatcher, arg_types) + "_slot"
                for key, arg_types in signatures.items()
            }
            for key, symbol in self._slots.items():
                llvmlite.binding.add_symbol(symbol, ctypes.addressof(self._words[key]))
        self.call = self._caller()

    def linked(self, key: str) -> bool:
        """Whether the helper is compiled for ``key`` and its word holds its address."""
        return bool(self._words[key].value)

    def link(self, key: str) -> None:
        """Compile (or load) the helper for ``key`` and put its address in its word."""
        word = self._words[key]
        if word.value or not self._jitted:
            return
        with self._lock:
            if word.value:
                return
            arg_types = self._signatures[key]
            address = _native_address(self._dispatcher, arg_types)
            got = self._dispatcher.overloads[arg_types].signature.return_type
            if got != self._restype:
                raise TypeError(
                    f"softorder: {self._dispatcher.py_func.__name__} returns {got}, "
                    f"declared {self._restype}"
                )
            word.value = address

    def unlink(self) -> None:
        """Every word back to 0, as in a fresh process (tests of the hand-back)."""
        for word in self._words.values():
            word.value = 0

    def _caller(self):
        """The intrinsic ``call(*args) -> (linked, out)`` (NUMBA_DISABLE_JIT: the helper's
        Python function, always linked).
        """
        dispatcher, restype = self._dispatcher, self._restype
        if not self._jitted:

            def call(*args):
                return True, dispatcher(*args)

            return call

        import numba
        from llvmlite import ir
        from numba.core import cgutils, errors, types

        name = dispatcher.py_func.__name__
        signatures, slots = self._signatures, self._slots

        @numba.extending.intrinsic
        def call(typingctx, *args):
            for key, arg_types in signatures.items():
                if len(args) == len(arg_types) and all(map(_accepted, args, arg_types)):
                    symbol = slots[key]
                    break
            else:
                wanted = list(signatures.values())
                raise errors.TypingError(f"softorder: {name} is called with {wanted}; got {args}")

            def codegen(context, builder, signature, llargs):
                word = ir.IntType(64)
                module = builder.module
                slot = module.globals.get(symbol) or ir.GlobalVariable(module, word, symbol)
                address = builder.load(slot)
                linked = builder.icmp_unsigned("!=", address, word(0))
                out = cgutils.alloca_once_value(builder, context.get_constant_null(restype))
                with builder.if_then(linked):
                    kind = context.call_conv.get_function_type(restype, arg_types)
                    callee = builder.inttoptr(address, kind.as_pointer())
                    packed = llargs[0]
                    value = _emit_call(context, builder, callee, restype, arg_types, args, packed)
                    builder.store(value, out)
                pair = (linked, builder.load(out))
                return context.make_tuple(builder, signature.return_type, pair)

            result = types.Tuple((types.boolean, restype))
            return result(types.StarArgTuple.from_types(args)), codegen

        return call


def internal_function(module, kind, name: str, noalias: int):
    """``(function, new)``: the LLVM function ``name`` of type ``kind`` in ``module``,
    internal and never inlined (one copy per module, called from every place that needs it),
    its first ``noalias`` pointer arguments marked ``noalias``; ``new`` when the caller is to
    write its body (the emitted loops of :mod:`softorder.core.sort_rows` and of the JAX
    bridge's handlers), false when ``module`` already defines it.
    """
    from numba.core import cgutils

    function = cgutils.get_or_insert_function(module, kind, name)
    if not function.is_declaration:
        return function, False
    function.linkage = "internal"
    function.attributes.add("noinline")
    for argument in function.args[:noalias]:
        argument.add_attribute("noalias")
    return function, True


def kernel(fn):
    """Compile a batched kernel whose first argument is the ``(rows, n)`` input.

    Rows run in parallel with ``numba.prange`` when the input is large enough
    (:data:`MIN_PARALLEL_ROWS`, :data:`MIN_PARALLEL_ELEMENTS`) and :func:`set_parallel` allows
    it, on the calling thread otherwise. ``kernel.serial`` is the serial dispatcher;
    ``kernel.parallel()`` returns the parallel one (compiling nothing until it is called).
    """
    # no C-callable wrapper: kernels are called from Python or by their native symbol (the
    # JAX bridge's handlers), never as C functions; the wrapper only lengthened a first call
    serial = _jit(fn, no_cfunc_wrapper=True)
    _kernels.add(id(serial))
    variant = []

    def parallel():
        if not variant:
            with _variant_lock:
                if not variant:
                    dispatcher = _jit(fn, "parallel", parallel=True, no_cfunc_wrapper=True)
                    _kernels.add(id(dispatcher))
                    variant.append(dispatcher)
        return variant[0]

    @functools.wraps(fn)
    def run(xs, *args):
        if (
            _parallel[0]
            and xs.shape[0] >= MIN_PARALLEL_ROWS
            and xs.size >= MIN_PARALLEL_ELEMENTS
            and not _pool_unusable[0]
        ):
            dispatcher = parallel()
            if _pool_lock.acquire(blocking=False):
                try:
                    return dispatcher(xs, *args)
                finally:
                    _pool_lock.release()
        return serial(xs, *args)

    run.serial = serial
    run.parallel = parallel
    return run
