"""The bundled gradient dumps load with h5py, hold real gradients and carry provenance."""

import pathlib

import h5py
import numpy as np
import pytest

DATASETS = pathlib.Path(__file__).resolve().parents[1] / "datasets"
FILES = ["minilm.h5", "digits_cnn.h5"]
ROOT_ATTRS = ["model", "seed", "date_utc", "command", "description"]
STEP_ATTRS = ["loss", "learning_rate", "batch_size", "step"]


@pytest.mark.parametrize("name", FILES)
def test_dump_has_provenance(name):
    with h5py.File(DATASETS / name, "r") as f:
        for a in ROOT_ATTRS:
            assert a in f.attrs, f"{name}: root attribute {a!r} missing"
        assert any(k.startswith("torch") for k in f.attrs), "library versions missing"
        steps = sorted(f)
        assert steps and all(s.startswith("step_") for s in steps)
        for s in steps:
            for a in STEP_ATTRS:
                assert a in f[s].attrs, f"{name}/{s}: attribute {a!r} missing"


@pytest.mark.parametrize("name", FILES)
def test_dump_holds_finite_nonzero_float32_gradients(name):
    with h5py.File(DATASETS / name, "r") as f:
        for s in f:
            assert len(f[s]) > 0
            for k, d in f[s].items():
                a = d[()]
                assert a.dtype == np.float32, f"{s}/{k} is {a.dtype}"
                assert np.all(np.isfinite(a)), f"{s}/{k} has non-finite values"
                assert np.any(a != 0), f"{s}/{k} is all zero"


def test_minilm_steps_differ():
    # Different steps are different batches: the demo gives each rank one of them.
    with h5py.File(DATASETS / "minilm.h5", "r") as f:
        steps = sorted(f)
        assert len(steps) >= 4
        k = "encoder.layer.0.attention.self.query.weight"
        a, b = f[steps[0]][k][()], f[steps[1]][k][()]
        assert not np.array_equal(a, b)


def test_bundled_size_within_budget():
    total = sum((DATASETS / n).stat().st_size for n in FILES)
    assert total <= 20 * 1024 * 1024
