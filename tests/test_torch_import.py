"""Importing the PyTorch bridge, and eager calls through it, do not import ``torch._dynamo``
(seconds of import time); only ``torch.compile`` and the torch.func paths need it."""

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

SCRIPT = """
import sys
import torch
assert "torch._dynamo" not in sys.modules, "torch alone imported dynamo"
import softorder.bridges.torch as sot
assert "torch._dynamo" not in sys.modules, "the import"
x = torch.tensor([[0.3, -1.2, 2.0, 0.7]], dtype=torch.float64, requires_grad=True)
alpha = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)
(sot.soft_topk(x, 2, alpha) * torch.arange(4.0)).sum().backward()
sot.soft_rank(x, 0.5).square().sum().backward()
sot.topk_cross_entropy(x, torch.tensor([1]), [0.5, 0.5], 0.5).backward()
(g,) = torch.autograd.grad(sot.soft_sort(x, 0.5).square().sum(), x, create_graph=True)
import torch.autograd.forward_ad as fwAD
with fwAD.dual_level():
    sot.soft_sort(fwAD.make_dual(x.detach(), torch.ones_like(x)), 0.5)
assert "torch._dynamo" not in sys.modules, "an eager forward and backward"
print("ok")
"""


def test_import_and_eager_calls_do_not_import_dynamo():
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("ok")
