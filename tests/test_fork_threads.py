"""fork, multiprocessing, DataLoader workers and threads after softorder calls (issue 12).

Each scenario runs in a fresh interpreter with a time limit, so that a child that dies or a
pool that hangs fails the test instead of blocking the run. The interpreters inherit
``NUMBA_CACHE_DIR`` (set by the repository's conftest) and reuse the compiled kernels.

The parents call softorder serially (small inputs) and, where it matters, in parallel too
(a 64 x 1000 batch with ``set_parallel(True)``, which starts numba's thread pool: GNU OpenMP
by default here); each script checks that the pool really started.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

TIMEOUT = 240  # seconds; a first run may compile the parallel kernels (once per cache)

PRELUDE = """
import os, sys
import numpy as np
import softorder
from softorder import core

def inputs(rows, n=1000, seed=0):
    return np.random.default_rng(seed).standard_normal((rows, n))

def work(seed):
    # one small (serial) and one batched call of two operations, forward and gradient
    x = inputs(3, 5, seed)
    big = inputs(64, 1000, seed)
    r = softorder.soft_rank(x, 0.5)
    p, pullback = softorder.vjp(softorder.soft_topk, big, 10, 0.5)
    return r, p, pullback(np.ones_like(p))[0]

def same(a, b):
    return all(np.array_equal(u, v) for u, v in zip(a, b, strict=True))

def start_pool():
    # a large batched call with threads allowed: numba's parallel kernels start its pool
    core.set_parallel(True)
    expected = work(1)
    from numba.np.ufunc import parallel
    assert parallel._is_initialized, "the thread pool did not start"
    return expected
"""


def run_script(tmp_path, body: str, env: dict | None = None) -> str:
    # a file, not ``-c``: spawn and forkserver workers import the script's functions from it
    script = tmp_path / "scenario.py"
    script.write_text(PRELUDE + textwrap.dedent(body))
    full_env = {**os.environ, **(env or {})}
    try:
        done = subprocess.run(
            [sys.executable, str(script)],
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            env=full_env,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"timed out after {TIMEOUT} s (a hang):\n{exc.stdout}\n{exc.stderr}")
    assert done.returncode == 0, f"exit code {done.returncode}\n{done.stdout}\n{done.stderr}"
    assert "OK" in done.stdout, done.stdout + done.stderr
    return done.stdout


def test_serial_calls_never_start_a_thread_pool(tmp_path):
    """Small inputs (threads allowed), and a large batch with threads off, stay on the calling
    thread without initialising numba's threading layer."""
    run_script(
        tmp_path,
        """
        x = inputs(4, 50)
        for fn, args in [
            (softorder.soft_rank, (x, 0.5)),
            (softorder.soft_sort, (x, 0.5)),
            (softorder.soft_topk, (x, 3, 0.5)),
            (softorder.soft_quantile, (x, 0.3, 0.5)),
            (softorder.soft_permutation, (x, 0.5)),
        ]:
            out, pullback = softorder.vjp(fn, *args)
            pullback(np.ones_like(out))
        core.set_parallel(False)
        softorder.soft_rank(inputs(64, 1000), 0.5)
        from numba.np.ufunc import parallel
        assert not parallel._is_initialized
        print("OK")
        """,
    )


@pytest.mark.parametrize("pool_started", [False, True], ids=["serial", "after-threads"])
def test_fork_then_call_in_child(tmp_path, pool_started):
    """The issue's reproduction: a call, ``os.fork()``, a call in the child; serially (as after
    ``set_parallel(False)``, or next to a bridge), and after the parent started the pool."""
    run_script(
        tmp_path,
        f"""
        from numba.np.ufunc import parallel

        softorder.soft_rank(np.random.rand(3, 5), 0.5)
        if {pool_started}:
            expected = start_pool()
        else:
            core.set_parallel(False)
            expected = work(1)
            assert not parallel._is_initialized
        pid = os.fork()
        if pid == 0:
            ok = same(work(1), expected)
            softorder.soft_rank(np.random.rand(3, 5), 0.5)
            os._exit(0 if ok else 3)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, os.waitstatus_to_exitcode(status)
        assert same(work(1), expected)  # the parent's pool still works
        print("OK")
        """,
    )


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_multiprocessing_pool(tmp_path, method):
    run_script(
        tmp_path,
        f"""
        import multiprocessing as mp

        if __name__ == "__main__":
            expected = start_pool()
            with mp.get_context("{method}").Pool(2) as pool:
                results = pool.map(work, [1, 1, 1])
            assert all(same(r, expected) for r in results)
            print("OK")
        """,
    )


def test_dataloader_workers_call_softorder(tmp_path):
    pytest.importorskip("torch")
    run_script(
        tmp_path,
        """
        import torch
        import softorder.bridges.torch as sot

        class Ranks(torch.utils.data.Dataset):
            def __len__(self):
                return 8

            def __getitem__(self, i):
                x = torch.from_numpy(inputs(1, 50, seed=i))
                return sot.soft_rank(x, 0.5)[0], softorder.soft_topk(inputs(64, 1000, i), 5, 0.5)

        expected = start_pool()
        sot.soft_rank(torch.rand(3, 5), 0.5)
        loader = torch.utils.data.DataLoader(
            Ranks(), batch_size=4, num_workers=2, multiprocessing_context="fork"
        )
        batches = list(loader)
        assert len(batches) == 2
        got = torch.cat([b[0] for b in batches]).numpy()
        want = np.stack([softorder.soft_rank(inputs(1, 50, seed=i), 0.5)[0] for i in range(8)])
        np.testing.assert_allclose(got, want, rtol=1e-12)
        print("OK")
        """,
    )


@pytest.mark.parametrize("layer", [None, "workqueue", "omp"])
def test_eight_threads_at_once(tmp_path, layer):
    """8 threads calling at once on 64 x 1000 inputs; with ``workqueue`` (not thread-safe),
    concurrent entry into numba's pool used to abort the process."""
    run_script(
        tmp_path,
        """
        import threading

        expected = start_pool()
        results = [None] * 8
        barrier = threading.Barrier(8)

        def call(i):
            barrier.wait()
            for _ in range(3):
                results[i] = work(1)

        threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(same(r, expected) for r in results)
        import numba
        print(numba.threading_layer())
        print("OK")
        """,
        env={"NUMBA_THREADING_LAYER": layer} if layer else None,
    )
