"""mp.empty/zeros/full/empty_like/zeros_like, share, share_memory_, is_shared."""
import gc

import numpy as np
import pytest

import sharedmp as mp
from sharedmp.arrays import mapping_of
from sharedmp.memory import recycle

from conftest import fds_on, memfd_maps

SHAPES = [
    (5, (5,)), ((2, 3), (2, 3)), ([4, 1, 2], (4, 1, 2)), (np.int64(7), (7,)),
    ((np.int32(2), 3), (2, 3)), ((), ()), (0, (0,)), ((3, 0, 2), (3, 0, 2)),
]
DTYPES = [np.float64, np.float32, np.float16, np.int8, np.uint16, ">i4", np.int64, np.bool_,
          np.complex64, np.complex128, "S5", "U3", "datetime64[ns]",
          [("x", "<f4"), ("y", ">i2"), ("z", "u1", (3,))]]


@pytest.mark.parametrize("fn", [mp.empty, mp.zeros])
@pytest.mark.parametrize("shape,expected", SHAPES, ids=[repr(e) for _, e in SHAPES])
def test_shapes(fn, shape, expected):
    a = fn(shape)
    assert type(a) is np.ndarray and a.shape == expected and a.dtype == np.float64
    assert mp.is_shared(a)
    assert a.flags.c_contiguous and a.flags.writeable and a.flags.aligned
    assert not a.any()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dtypes(dtype):
    a = mp.zeros((3, 4), dtype)
    assert a.dtype == np.dtype(dtype) and a.dtype.str == np.dtype(dtype).str
    assert a.tobytes() == np.zeros((3, 4), dtype).tobytes()
    assert mp.is_shared(a)


def test_bad_shapes_and_dtypes():
    with pytest.raises(ValueError, match="negative"):
        mp.zeros((2, -1))
    with pytest.raises(TypeError):
        mp.zeros(2.5)
    with pytest.raises(TypeError, match="object"):
        mp.zeros(3, object)
    with pytest.raises(TypeError, match="object"):
        mp.empty(3, [("a", "i4"), ("o", "O")])


def test_fortran_order():
    for fn in (mp.empty, mp.zeros):
        a = fn((3, 4, 5), np.int32, order="F")
        assert a.flags.f_contiguous and not a.flags.c_contiguous
        assert a.strides == np.zeros((3, 4, 5), np.int32, order="F").strides
        assert mp.is_shared(a)
    f = mp.full((2, 3), 7, order="F")
    assert f.flags.f_contiguous and (f == 7).all()


def test_full():
    a = mp.full((2, 3), 1.5)
    assert a.dtype == np.float64 and (a == 1.5).all() and mp.is_shared(a)
    b = mp.full(4, 3)
    assert b.dtype == np.full(4, 3).dtype and (b == 3).all()
    c = mp.full((2, 2), 2 - 1j, dtype=np.complex64)
    assert c.dtype == np.complex64 and (c == 2 - 1j).all()
    d = mp.full(3, True)
    assert d.dtype == np.bool_ and d.all()
    e = mp.full((2, 3), [1, 2, 3], dtype=np.int16)          # broadcast like np.full
    assert e.dtype == np.int16 and (e == [1, 2, 3]).all()
    z = mp.full((), 9.0)
    assert z.shape == () and z[()] == 9.0
    assert mp.full(0, 5).shape == (0,)


def test_like():
    src = np.arange(12, dtype=">i2").reshape(3, 4)
    for fn in (mp.empty_like, mp.zeros_like):
        a = fn(src)
        assert a.shape == (3, 4) and a.dtype == src.dtype and mp.is_shared(a)
        assert fn(src, dtype=np.float32).dtype == np.float32
        assert fn(src, shape=(2, 5)).shape == (2, 5)
        assert fn([[1, 2], [3, 4]]).shape == (2, 2)
        assert fn(np.float32(3)).shape == ()
    assert not mp.zeros_like(src).any()


def test_zeros_are_zero_after_memory_was_used():
    """Memory is never handed out twice, so fresh arrays are zero without a fill."""
    for _ in range(3):
        junk = [mp.empty(1000) for _ in range(100)]
        for j in junk:
            j[:] = 1.0
        del junk
        gc.collect()
        assert not any(mp.zeros(1000).any() for _ in range(100))


def test_share_returns_shared_arrays_themselves():
    a = mp.zeros((4, 4))
    assert mp.share(a) is a
    v = a[1:, ::2]
    assert mp.share(v) is v                                 # a view of shared memory is shared


@pytest.mark.parametrize("make", [
    lambda: np.arange(12.0).reshape(3, 4),
    lambda: np.arange(12.0).reshape(3, 4).T,
    lambda: np.arange(12)[::-2],
    lambda: np.array(5, np.int8),
    lambda: np.zeros((0, 4)),
    lambda: np.array([(1, b"a")], dtype=[("n", "<i8"), ("s", "S2")]),
], ids=["c", "transpose", "negative", "0-d", "empty", "structured"])
def test_share_copies_plain_arrays(make):
    a = make()
    s = mp.share(a)
    assert s is not a and mp.is_shared(s) and not mp.is_shared(a)
    assert s.shape == a.shape and s.strides == a.strides and s.dtype == a.dtype
    assert s.tobytes() == a.tobytes()
    if a.size:
        assert not np.shares_memory(s, a)
        s[(0,) * s.ndim] = s[(-1,) * s.ndim]
        assert a.tobytes() == make().tobytes()              # the original is untouched


def test_share_keeps_read_only():
    a = np.arange(4)
    a.flags.writeable = False
    s = mp.share(a)
    assert mp.is_shared(s) and not s.flags.writeable


def test_share_refuses_what_cannot_be_shared():
    with pytest.raises(TypeError):
        mp.share(np.array([None, 1], dtype=object))
    with pytest.raises(TypeError):
        mp.share([1, 2, 3])


def test_share_memory_of_ndarray_points_to_share():
    with pytest.raises(TypeError, match=r"mp\.share"):
        mp.share_memory_(np.zeros(3))
    with pytest.raises(TypeError, match=r"mp\.share"):
        mp.share_memory_(mp.zeros(3))
    with pytest.raises(TypeError):
        mp.share_memory_([1, 2])


def test_is_shared():
    a = mp.zeros((3, 3))
    assert mp.is_shared(a) and mp.is_shared(a.T) and mp.is_shared(a[1]) and mp.is_shared(a[1:1])
    assert mp.is_shared(a.view(np.uint8)) and mp.is_shared(a.reshape(9))
    assert mp.is_shared(np.asarray(a)) and mp.is_shared(np.frombuffer(a, np.uint8))
    assert not mp.is_shared(np.zeros(3)) and not mp.is_shared(a.copy()) and not mp.is_shared(a + 1)
    # views numpy builds over a helper object (DummyArray) are views of shared memory too
    assert mp.is_shared(np.lib.stride_tricks.as_strided(a, (2, 2), (8, 8)))
    assert mp.is_shared(np.lib.stride_tricks.sliding_window_view(a[0], 2))
    assert not mp.is_shared(np.lib.stride_tricks.sliding_window_view(np.zeros(4), 2))
    window = np.lib.stride_tricks.as_strided(a, (2,), (8,))
    assert mp.share(window) is window                       # not copied: already shared
    assert not mp.is_shared([1, 2]) and not mp.is_shared(None) and not mp.is_shared(3.0)


def _fds_and_maps(key):
    return fds_on(key), memfd_maps(key)


def test_big_array_memory_and_fd_go_with_last_view(pool_stays):
    mp.set_sharing_strategy("file_descriptor")
    a = mp.zeros((1024, 256))                               # 2 MiB: its own segment
    key = mapping_of(a)[1].key
    fds, maps = _fds_and_maps(key)
    assert len(fds) >= 1 and len(maps) == 1
    v = a[::7, 3]
    del a
    gc.collect()
    assert _fds_and_maps(key) == (fds, maps)              # the view keeps it
    del v
    gc.collect()
    kept_fds, kept_maps = _fds_and_maps(key)         # kept for reuse: the fd it sent is closed
    assert len(kept_fds) == len(fds) - 1 and kept_maps == maps and recycle.kept()[0] >= 1
    recycle.clear()
    assert _fds_and_maps(key) == ([], [])
