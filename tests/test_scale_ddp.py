"""PyTorch DistributedDataParallel: 2 CPU processes (gloo) train like one on the whole batch.

Each case trains a tiny model whose loss is a softorder operation, with a learnable ``alpha``
(an ``nn.Parameter`` of the loss, all-reduced by DDP like any other parameter), for a few SGD
steps: under DDP, each of 2 processes started by ``torch.multiprocessing.spawn`` takes half of
the batch; alone, one process takes the whole batch. DDP averages the gradients over the
ranks, so a per-rank ``"mean"`` loss over equal shards gives the gradient of the mean over the
whole batch, and the parameters must agree to float32 rounding.

The processes meet through a ``FileStore`` in a temporary folder (no TCP store) and gloo
connects them over the loopback only (``GLOO_SOCKET_IFNAME=lo``); each worker checks that
every socket it holds is bound to 127.0.0.1. The script runs in a child process, so that the
spawned workers import it as their ``__main__`` whatever way pytest imported this module.
"""

import json
import os
import pathlib
import subprocess
import sys
import tempfile

import pytest

pytest.importorskip("torch")

WORLD = 2
BATCH, FEATURES, CLASSES, ITEMS = 8, 4, 6, 5
STEPS, LR = 3, 0.5
CASES = ("topk", "rank")


def _model(case: str):
    import torch
    from torch import nn

    import softorder.bridges.torch as sot

    class TopK(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(FEATURES, CLASSES)
            self.loss = sot.TopKCrossEntropyLoss(
                [0.5, 0.5], alpha=nn.Parameter(torch.tensor(1.0)), split_top1=True
            )

        def forward(self, x, y):
            return self.loss(self.linear(x), y)

    class Rank(nn.Module):
        """Scores ``ITEMS`` items from their features; squared error of their soft ranks."""

        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(FEATURES, 1, bias=False)  # ranks ignore a shift
            self.alpha = nn.Parameter(torch.tensor(0.5))

        def forward(self, x, target_ranks):
            scores = self.linear(x).squeeze(-1)  # (rows, ITEMS)
            ranks = sot.soft_rank(scores, self.alpha)
            return ((ranks - target_ranks) ** 2).mean()

    torch.manual_seed(0)
    return TopK() if case == "topk" else Rank()


def _data(case: str):
    import torch

    g = torch.Generator().manual_seed(1)
    if case == "topk":
        x = torch.randn(BATCH, FEATURES, generator=g)
        y = torch.randint(0, CLASSES, (BATCH,), generator=g)
    else:
        x = torch.randn(BATCH, ITEMS, FEATURES, generator=g)
        y = torch.stack([torch.randperm(ITEMS, generator=g) + 1.0 for _ in range(BATCH)])
    return x, y


def _train(model, x, y) -> list[float]:
    import torch

    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = model(x, y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _parameters(module) -> dict:
    return {name: p.detach().tolist() for name, p in module.named_parameters()}


def _inet_sockets() -> list[str]:
    """Local addresses (hex, as in /proc/net/tcp*) of this process's TCP sockets."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    addresses = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[9] in inodes:
                    addresses.append(fields[1].split(":")[0])
    return addresses


#: each worker's last collective (see _worker)
_LAST_WORK: list = []

LOOPBACK = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}


def _worker(rank: int, folder: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(folder, "store"), WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    results = {}
    try:
        for case in CASES:
            model = DistributedDataParallel(_model(case))
            x, y = _data(case)
            shard = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
            losses = _train(model, x[shard], y[shard])
            results[case] = {"parameters": _parameters(model.module), "losses": losses}
        sockets = _inet_sockets()
        # kept until the process exits, as in docs/scaling.rst (which says why)
        _LAST_WORK.append(dist.barrier(async_op=True))
        _LAST_WORK[-1].wait()
    finally:
        dist.destroy_process_group()
    results["sockets"] = len(sockets)
    results["not_loopback"] = [a for a in sockets if a not in LOOPBACK]
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


def _child() -> None:  # runs in the child process
    import torch
    import torch.multiprocessing as mp

    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # inherited by the workers
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_worker, args=(folder,), nprocs=WORLD, join=True)
        ranks = []
        for rank in range(WORLD):
            with open(os.path.join(folder, f"rank{rank}.json")) as f:
                ranks.append(json.load(f))
    out = {"ranks": ranks}
    for case in CASES:
        model = _model(case)
        initial = _parameters(model)
        losses = _train(model, *_data(case))
        out[case] = {"single": _parameters(model), "initial": initial, "losses": losses}
    print(json.dumps(out))


@pytest.fixture(scope="module")
def trained() -> dict:
    """Both cases, trained under DDP by 2 spawned processes and alone by one."""
    done = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-5000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_ddp_binds_to_the_loopback_only(trained):
    for rank in trained["ranks"]:
        assert rank["sockets"] > 0 and rank["not_loopback"] == []


@pytest.mark.parametrize("case", CASES)
def test_ddp_equals_one_process_on_the_whole_batch(trained, case):
    import numpy as np

    single, initial = trained[case]["single"], trained[case]["initial"]
    alpha = "loss.alpha" if case == "topk" else "alpha"
    assert alpha in single  # alpha is a parameter of the model DDP wraps
    for rank in trained["ranks"]:
        parameters = rank[case]["parameters"]
        assert parameters.keys() == single.keys()
        for name, value in single.items():
            np.testing.assert_allclose(parameters[name], value, rtol=2e-5, atol=2e-6, err_msg=name)
    # the steps moved every parameter, alpha too, so the comparison is not of initial values
    for name in single:
        assert not np.allclose(single[name], initial[name], rtol=1e-4, atol=1e-4), name
    # each rank's loss is the mean over its half: before the first step, their average is the
    # whole batch's loss
    first = np.mean([rank[case]["losses"][0] for rank in trained["ranks"]])
    np.testing.assert_allclose(first, trained[case]["losses"][0], rtol=1e-5)


def _docs_script() -> str:
    """The DDP script of docs/scaling.rst: the code block after the line naming it."""
    page = pathlib.Path(__file__).resolve().parent.parent / "docs" / "scaling.rst"
    lines = page.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if "ddp_topk.py" in line)
    start = next(i for i in range(start, len(lines)) if lines[i] == ".. code-block:: python")
    block = []
    for line in lines[start + 1 :]:
        if line and not line.startswith("    "):
            break
        block.append(line[4:])
    return "\n".join(block).strip() + "\n"


def test_the_docs_script_runs(tmp_path):
    script = tmp_path / "ddp_topk.py"
    script.write_text(_docs_script(), encoding="utf-8")
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-5000:]
    assert done.stdout.strip().splitlines()[-1] == "DDP equals one process: True"


if __name__ == "__main__":
    _child()
