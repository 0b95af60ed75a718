"""Helpers for the HDF5 and command-line tests: a sample file with every kind of member,
comparisons of two files' trees, and ways to damage a compressed file."""

from __future__ import annotations

import os

import h5py
import numpy as np
from kit import assert_within

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MINILM = os.path.join(ROOT, "datasets", "minilm.h5")
DIGITS = os.path.join(ROOT, "datasets", "digits_cnn.h5")


def make_sample(path: str) -> None:
    """Groups with attributes of several HDF5 types, floats of every supported kind (2-D,
    1-D float64, float16, big-endian, scalar, empty, with NaN/Inf, chunked+gzip), and
    members that must be copied unchanged (ints, strings, a null dataspace, links).

    The scalar, the empty and the constant dataset are ones whose stream cannot be smaller
    than their data (`ccoll compress` keeps them as they are, unless always_stream); every
    other float dataset is large enough for a stream to pay at REL bounds, and at ABS
    bounds coarser than float16's spacing."""
    rng = np.random.default_rng(7)
    # Creation order tracked (as the capture script does): copies must list members and
    # attributes in the same order, not by name.
    with h5py.File(path, "w", track_order=True) as f:
        f.attrs["model"] = "sample"
        f.attrs.create("fixed", np.bytes_("fixed-len"))
        f.attrs["seed"] = np.int64(7)
        f.attrs["lrs"] = np.array([1e-3, 2e-3])
        f.attrs["names"] = ["a", "bb"]
        f.attrs["empty"] = h5py.Empty("f4")
        g = f.create_group("step_0000", track_order=True)
        g.attrs["loss"] = 0.25
        g.attrs["step"] = 0
        w = g.create_dataset(
            "fc.weight", data=rng.standard_normal((64, 33)).astype(np.float32), track_order=True
        )
        w.attrs["rows"] = "0:64"
        w.attrs["full_shape"] = np.array([128, 33])
        g.create_dataset("fc.bias", data=rng.standard_normal(256) * 1e-3)  # float64
        g.create_dataset("half", data=(rng.standard_normal((20, 30)) * 100).astype(np.float16))
        g.create_dataset("big_endian", data=rng.standard_normal(300).astype(">f4"))
        g.create_dataset("scalar", data=np.float32(3.5))
        g.create_dataset("empty", shape=(0, 3), dtype="f4")
        g.create_dataset("const", data=np.full(40, 2.5, np.float32))
        special = rng.standard_normal(300).astype(np.float32)
        special[[3, 40]] = np.nan
        special[5], special[6] = np.inf, -np.inf
        g.create_dataset("special", data=special)
        g.create_dataset(
            "chunked",
            data=rng.standard_normal((100, 10)).astype(np.float32),
            chunks=(10, 10),
            compression="gzip",
        )
        sub = g.create_group("sub")
        sub.attrs["note"] = "nested"
        sub.create_dataset(
            "deep.weight", data=rng.standard_normal((3, 4, 5, 6, 2)).astype(np.float32)
        )
        f.create_dataset("labels", data=np.arange(10, dtype=np.int32))
        f.create_dataset("text", data=["x", "yz"], dtype=h5py.string_dtype())
        f.create_dataset("nothing", shape=None, dtype="f4")
        f["alias"] = h5py.SoftLink("/step_0000/fc.weight")
        f["outside"] = h5py.ExternalLink("other.h5", "/x")


def attrs_of(obj) -> dict:
    out = {}
    for k in obj.attrs:
        v = obj.attrs[k]
        out[k] = (
            obj.attrs.get_id(k).dtype,
            repr(v) if isinstance(v, h5py.Empty) else np.asarray(v).tolist(),
        )
    return out


def members(f: h5py.File) -> dict:
    """Path -> kind for every member, links included (not followed)."""
    out = {}

    def rec(g):
        for name in g:
            link = g.get(name, getlink=True)
            path = g.name.rstrip("/") + "/" + name
            if isinstance(link, (h5py.SoftLink, h5py.ExternalLink)):
                out[path] = repr(link.path) + type(link).__name__
                continue
            obj = g[name]
            out[path] = type(obj).__name__
            if isinstance(obj, h5py.Group):
                rec(obj)

    rec(f)
    return out


def assert_restored(original: str, restored: str, eb_of, *, check: set[str] | None = None) -> int:
    """Same members, attributes, dtypes and shapes; float datasets within ``eb_of(path, x)``;
    every other dataset identical. Returns the number of float datasets checked."""
    n = 0
    with h5py.File(original) as a, h5py.File(restored) as b:
        assert attrs_of(a) == attrs_of(b) and list(a.attrs) == list(b.attrs)
        ma, mb = members(a), members(b)
        assert ma == mb and list(ma) == list(mb)  # same members, listed in the same order
        for path, kind in ma.items():
            if kind == "Group":
                assert attrs_of(a[path]) == attrs_of(b[path]), path
            if kind != "Dataset":
                continue
            x, y = a[path], b[path]
            assert attrs_of(x) == attrs_of(y) and list(x.attrs) == list(y.attrs), path
            assert x.dtype == y.dtype and x.shape == y.shape, (
                path,
                x.dtype,
                y.dtype,
                x.shape,
                y.shape,
            )
            if x.shape is None:
                continue
            xv, yv = x[()], y[()]
            if x.dtype.kind == "f" and (check is None or path in check):
                assert_within(np.asarray(yv), np.asarray(xv), eb_of(path, np.asarray(xv)))
                n += 1
            elif x.dtype.kind != "f":
                assert np.array_equal(np.asarray(xv), np.asarray(yv)), path
            else:
                assert np.array_equal(np.asarray(xv), np.asarray(yv), equal_nan=True), path
    return n


def replace_stored(path: str, dataset: str, fn) -> None:
    """Rewrite the stored bytes of a compressed dataset with ``fn(bytes_array)``, keeping its
    attributes (a damaged file that HDF5 still reads)."""
    with h5py.File(path, "r+") as f:
        ds = f[dataset]
        data = fn(ds[()].copy())
        saved = {k: (ds.attrs[k], ds.attrs.get_id(k).dtype) for k in ds.attrs}
        del f[dataset]
        new = f.create_dataset(dataset, data=data)
        for k, (v, dt) in saved.items():
            new.attrs.create(k, v, dtype=dt)


def flip_byte(path: str, dataset: str, index: int) -> None:
    """Flip one byte of a compressed dataset's stored bytes."""

    def fn(b):
        b[index] ^= 0xFF
        return b

    replace_stored(path, dataset, fn)
