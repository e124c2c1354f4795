"""Hard (non-differentiable) floors: NumPy and PyTorch sort, argsort and top-k of one row."""

from ._common import DTYPES, N_VALUES, _Forward, make_input, require, top_k


class NumpySort(_Forward):
    """``np.sort`` of one row."""

    params = (N_VALUES, DTYPES)
    param_names = ("n", "dtype")

    def setup(self, n, dtype):
        np = require("numpy")
        x = make_input("random", (n,), dtype)
        self.prepare(lambda: np.sort(x))


class NumpyArgsort(_Forward):
    """``np.argsort`` of one row (what softorder's forward starts with)."""

    params = (N_VALUES, DTYPES)
    param_names = ("n", "dtype")

    def setup(self, n, dtype):
        np = require("numpy")
        x = make_input("random", (n,), dtype)
        self.prepare(lambda: np.argsort(x))


class TorchSort(_Forward):
    """``torch.sort`` of one row (values and indices)."""

    params = (N_VALUES, DTYPES)
    param_names = ("n", "dtype")

    def setup(self, n, dtype):
        torch = require("torch")
        x = torch.from_numpy(make_input("random", (n,), dtype))
        self.prepare(lambda: torch.sort(x))


class TorchTopk(_Forward):
    """``torch.topk`` of one row with k = n / 10."""

    params = (N_VALUES, DTYPES)
    param_names = ("n", "dtype")

    def setup(self, n, dtype):
        torch = require("torch")
        x = torch.from_numpy(make_input("random", (n,), dtype))
        k = top_k(n)
        self.prepare(lambda: torch.topk(x, k))
