"""JAX sharding: a batch sharded over 2 host devices stays sharded through the operations.

The recipe (docs/scaling.rst): ``jax.shard_map`` over the batch axis around the bridge's
functions, inside ``jax.jit`` and ``jax.grad``, through the callbacks and through the FFI
route (which a traced alpha takes). Each device's callback or FFI call must see only its own
rows, the compiled program must hold no all-gather, and values and gradients must equal the
unsharded call. JAX fixes its device count when it is imported, so the checks run in a child
process started with ``XLA_FLAGS=--xla_force_host_platform_device_count=2``.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("jax")

DEVICES = 2
ROWS, N, CLASSES = 8, 6, 5


def _child(route: str) -> None:  # runs in the child process
    import warnings

    warnings.simplefilter("error")
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import softorder
    import softorder.bridges.jax as soj

    assert len(jax.devices()) == DEVICES, jax.devices()
    seen = []  # (callback, rows it received)
    # (the CPU callbacks write into XLA's buffers: in_place(ctx, out, *buffers))
    in_place = soj._Callbacks.in_place

    def record(self, ctx, out, *buffers):
        direction = "forward" if self.wanted is None else "backward"
        seen.append((direction, self.call.spec.op, np.shape(buffers[0])[0]))
        return in_place(self, ctx, out, *buffers)

    soj._Callbacks.in_place = record
    if route == "callbacks":
        soj._FFI_CALLS = False
    else:  # the FFI route (a traced alpha takes it): the rows each handler call is traced on
        ffi_forward, ffi_backward = soj._Ffi.forward, soj._Ffi.backward

        def forward(self, arrays, keep):
            seen.append(("forward", self.handler, np.shape(arrays[0])[0]))
            return ffi_forward(self, arrays, keep)

        def backward(self, arrays, residuals, cotangent, wanted):
            seen.append(("backward", self.handler, np.shape(arrays[0])[0]))
            return ffi_backward(self, arrays, residuals, cotangent, wanted)

        soj._Ffi.forward, soj._Ffi.backward = forward, backward

    mesh = Mesh(np.array(jax.devices()), ("batch",))
    rows = NamedSharding(mesh, P("batch"))
    rng = np.random.default_rng(0)
    x_np = rng.normal(size=(ROWS, N)).astype(np.float32)
    w_np = rng.normal(size=(ROWS, N)).astype(np.float32)
    logits_np = rng.normal(size=(ROWS, CLASSES)).astype(np.float32)
    labels_np = rng.integers(0, CLASSES, size=ROWS)
    p_k = jnp.array([0.5, 0.5])
    x, w = jax.device_put(x_np, rows), jax.device_put(w_np, rows)
    logits, labels = jax.device_put(logits_np, rows), jax.device_put(labels_np, rows)
    report = {}

    # soft_rank with a replicated, learnable alpha: its gradient is summed over the devices.
    sharded_rank = jax.shard_map(
        soj.soft_rank, mesh=mesh, in_specs=(P("batch"), P()), out_specs=P("batch")
    )

    def rank_loss(rank_fn, x, w, alpha):
        return jnp.sum(rank_fn(x, alpha) * w)

    grad_rank = jax.jit(jax.grad(rank_loss, argnums=(1, 3)), static_argnums=0)
    seen.clear()
    gx, galpha = jax.block_until_ready(grad_rank(sharded_rank, x, w, 0.7))
    report["rank_rows"] = sorted(seen)
    assert gx.sharding.spec == P("batch"), gx.sharding  # the gradient stays sharded too
    ref_gx, ref_galpha = jax.jit(jax.grad(rank_loss, argnums=(1, 3)), static_argnums=0)(
        soj.soft_rank, x_np, w_np, 0.7
    )
    np.testing.assert_allclose(gx, ref_gx, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(galpha, ref_galpha, rtol=1e-5)
    # against the NumPy API: its vjp, on the whole batch in float64
    ranks, pullback = softorder.vjp(softorder.soft_rank, x_np.astype(np.float64), alpha=0.7)
    np_gx, np_galpha = pullback(w_np.astype(np.float64))
    np.testing.assert_allclose(gx, np_gx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(galpha, np_galpha, rtol=1e-4)
    value = jax.jit(sharded_rank)(x, 0.7)
    np.testing.assert_allclose(value, ranks, rtol=1e-6)
    hlo = grad_rank.lower(sharded_rank, x, w, 0.7).compile().as_text()
    report["rank_all_gathers"] = hlo.count("all-gather")
    # the detector works: the same loss without shard_map gathers the batch on one device
    plain = grad_rank.lower(soj.soft_rank, x, w, 0.7).compile().as_text()
    report["plain_all_gathers"] = plain.count("all-gather")
    plain_gx, plain_galpha = grad_rank(soj.soft_rank, x, w, 0.7)  # gathered, still right
    np.testing.assert_allclose(plain_gx, ref_gx, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(plain_galpha, ref_galpha, rtol=1e-5)

    # soft_topk with a per-row k, sharded like the rows, and a replicated alpha
    k_np = rng.uniform(1.0, N - 1.0, size=ROWS).astype(np.float32)
    k = jax.device_put(k_np, rows)
    sharded_topk = jax.shard_map(
        soj.soft_topk, mesh=mesh, in_specs=(P("batch"), P("batch"), P()), out_specs=P("batch")
    )

    def topk_sum(topk_fn, x, k, w, alpha):
        return jnp.sum(topk_fn(x, k, alpha) * w)

    grad_members = jax.jit(jax.grad(topk_sum, argnums=(1, 2, 4)), static_argnums=0)
    seen.clear()
    got = jax.block_until_ready(grad_members(sharded_topk, x, k, w, 0.4))
    report["members_rows"] = sorted(seen)
    expected = grad_members(soj.soft_topk, x_np, k_np, w_np, 0.4)
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)
    assert got[1].sharding.spec == P("batch")  # k's gradient stays with its rows

    # topk_cross_entropy: per-row losses on each device, the mean taken over the sharded rows.
    def row_losses(logits, labels, alpha):
        return soj.topk_cross_entropy(logits, labels, p_k, alpha, reduction="none")

    sharded_losses = jax.shard_map(
        row_losses, mesh=mesh, in_specs=(P("batch"), P("batch"), P()), out_specs=P("batch")
    )

    def topk_loss(logits, labels, alpha):
        return jnp.mean(sharded_losses(logits, labels, alpha))

    grad_topk = jax.jit(jax.value_and_grad(topk_loss, argnums=(0, 2)))
    seen.clear()
    loss, (glogits, galpha) = jax.block_until_ready(grad_topk(logits, labels, 0.5))
    report["topk_rows"] = sorted(seen)

    def reference(logits, labels, alpha):
        return soj.topk_cross_entropy(logits, labels, p_k, alpha)

    ref_loss, (ref_glogits, ref_galpha) = jax.jit(jax.value_and_grad(reference, (0, 2)))(
        logits_np, labels_np, 0.5
    )
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    np.testing.assert_allclose(glogits, ref_glogits, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(galpha, ref_galpha, rtol=1e-5)
    np_loss = softorder.topk_cross_entropy(logits_np.astype(np.float64), labels_np, [0.5, 0.5], 0.5)
    np.testing.assert_allclose(loss, np_loss, rtol=1e-5)
    hlo = grad_topk.lower(logits, labels, 0.5).compile().as_text()
    report["topk_all_gathers"] = hlo.count("all-gather")
    print(json.dumps(report))


@pytest.mark.parametrize("route", ["callbacks", "ffi"])
def test_shard_map_keeps_the_batch_sharded(route):
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}"
    )
    env["JAX_PLATFORMS"] = "cpu"
    done = subprocess.run(
        [sys.executable, __file__, route],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-5000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    local = ROWS // DEVICES
    # every callback, forward and backward, ran once per device on that device's rows only;
    # an FFI call was traced once, on one device's rows (the run is the HLO's: no all-gather)
    runs = 2 if route == "callbacks" else 1
    rank, loss = ("soft_rank", "topk_cross_entropy") if runs == 2 else ("rank", "topk_loss")
    assert (
        report["rank_rows"]
        == [["backward", rank, local]] * runs + [["forward", rank, local]] * runs
    )
    # (a traced k per row takes the callbacks on either route)
    assert report["members_rows"] == [
        ["backward", "soft_topk", local],
        ["backward", "soft_topk", local],
        ["forward", "soft_topk", local],
        ["forward", "soft_topk", local],
    ]
    assert (
        report["topk_rows"]
        == [["backward", loss, local]] * runs + [["forward", loss, local]] * runs
    )
    assert report["rank_all_gathers"] == 0
    assert report["topk_all_gathers"] == 0
    assert report["plain_all_gathers"] > 0


if __name__ == "__main__":
    _child(sys.argv[1])
