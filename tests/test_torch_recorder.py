"""GradientRecorder writes the datasets/ HDF5 layout from any training loop."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ccoll.torch import GradientRecorder  # noqa: E402


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(4, 3)
        self.head = torch.nn.Linear(3, 2)
        self.unused = torch.nn.Linear(2, 2)  # never in the loss: no gradient

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


class Wrapper(torch.nn.Module):
    """Stands in for DistributedDataParallel, which keeps the model as `.module`."""

    def __init__(self, m: torch.nn.Module) -> None:
        super().__init__()
        self.module = m


def train(rec: GradientRecorder, model: torch.nn.Module, steps: int) -> list[dict[str, np.ndarray]]:
    torch.manual_seed(0)
    net = getattr(model, "module", model)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    seen = []
    for step in range(steps):
        loss = net(torch.randn(8, 4)).square().mean()
        opt.zero_grad()
        loss.backward()
        rec.record(model, step, loss=loss, lr=0.1, batch_size=8, phase="train")
        seen.append(
            {n: p.grad.numpy().copy() for n, p in net.named_parameters() if p.grad is not None}
        )
        opt.step()
    return seen


@pytest.mark.parametrize("wrapped", [False, True], ids=["plain", "ddp-like"])
def test_layout_and_values(tmp_path, wrapped: bool) -> None:
    path = tmp_path / "g.h5"
    net = Net()
    model = Wrapper(net) if wrapped else net
    with GradientRecorder(path, every=2, model="Net", seed=7, attrs={"run": "unit"}) as rec:
        seen = train(rec, model, 5)
    with h5py.File(path, "r") as f:
        assert list(f.keys()) == ["step_0000", "step_0002", "step_0004"]
        for k in ("model", "seed", "date_utc", "command", "torch_version", "numpy_version",
                  "h5py_version", "description", "run", "steps_recorded"):
            assert k in f.attrs, k
        assert f.attrs["model"] == "Net" and f.attrs["seed"] == 7 and f.attrs["steps_recorded"] == 3
        # No ccoll_ name: those are the compressed format's (ccoll_version marked the
        # recorded file as one ccoll compress wrote, and compress refused it).
        assert "recorder_ccoll_version" in f.attrs
        assert not [k for k in f.attrs if k.startswith("ccoll_")]
        for step in (0, 2, 4):
            g = f[f"step_{step:04d}"]
            assert g.attrs["step"] == step and g.attrs["batch_size"] == 8
            assert g.attrs["learning_rate"] == pytest.approx(0.1)
            assert np.isfinite(g.attrs["loss"]) and g.attrs["phase"] == "train"
            assert g.attrs["params_without_grad"] == "unused.weight,unused.bias"
            assert list(g.keys()) == ["body.weight", "body.bias", "head.weight", "head.bias"]
            for name, ds in g.items():
                assert ds.dtype == np.float32 and ds.compression is None
                assert np.array_equal(ds[()], seen[step][name])


def test_patterns_select_parameters(tmp_path) -> None:
    path = tmp_path / "g.h5"
    with GradientRecorder(path, params=["head.*", "body.bias"]) as rec:
        train(rec, Net(), 1)
    with h5py.File(path, "r") as f:
        assert list(f["step_0000"].keys()) == ["body.bias", "head.weight", "head.bias"]
        assert f.attrs["params_selected"] == "head.*,body.bias"


def test_disabled_writes_nothing(tmp_path) -> None:
    rec = GradientRecorder(tmp_path / "g.h5", enabled=False)
    assert train(rec, Net(), 2)
    rec.close()
    assert not (tmp_path / "g.h5").exists()


@pytest.mark.parametrize(
    ("kw", "exc", "match"),
    [
        ({"every": 0}, ValueError, "every must be an int >= 1"),
        ({"every": 1.5}, ValueError, "every must be an int >= 1"),
        ({"params": "head.*"}, TypeError, "list of name patterns"),
        ({"params": [1]}, TypeError, "str patterns"),
    ],
)
def test_bad_arguments(tmp_path, kw, exc, match) -> None:
    with pytest.raises(exc, match=match):
        GradientRecorder(tmp_path / "g.h5", **kw)


def test_record_after_close_and_twice(tmp_path) -> None:
    rec = GradientRecorder(tmp_path / "g.h5")
    net = Net()
    net(torch.ones(1, 4)).sum().backward()
    assert rec.record(net, 0)
    with pytest.raises(ValueError, match="already recorded"):
        rec.record(net, 0)
    rec.close()
    rec.close()
    with pytest.raises(ValueError, match="is closed"):
        rec.record(net, 1)


def test_a_recorded_file_compresses_and_restores(tmp_path) -> None:
    from ccoll.h5.compress import compress_file
    from ccoll.h5.decompress import decompress_file

    path, c, back = tmp_path / "g.h5", str(tmp_path / "c.h5"), str(tmp_path / "b.h5")
    with GradientRecorder(path, every=1, model="Net", seed=1) as rec:
        seen = train(rec, Net(), 2)
    compress_file(str(path), c, "abs:1e-4")
    decompress_file(c, back)
    with h5py.File(back, "r") as f:
        for step in (0, 1):
            for name, ds in f[f"step_{step:04d}"].items():
                assert np.max(np.abs(ds[()].astype(np.float64) - seen[step][name])) <= 1e-4
