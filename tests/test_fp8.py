"""CPU tests of cupaged.fp8 (float8 e4m3 bit patterns for fp8 KV caches).

Expected bit patterns are written out by hand from the e4m3fn format (sign,
4 exponent bits with bias 7, 3 mantissa bits; 0x7e = 448 the largest finite,
0x7f / 0xff NaN), not computed with ml_dtypes.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cupaged
from cupaged import fp8
from cupaged.errors import DTypeError, InvalidArgumentError, ShapeError

# value -> e4m3fn bits, by hand: 1.0 = 2^0 -> exponent 7 = 0111, mantissa 000
KNOWN = [
    (0.0, 0x00),
    (-0.0, 0x80),
    (1.0, 0x38),
    (-1.0, 0xB8),
    (1.5, 0x3C),            # 1.100b
    (-2.0, 0xC0),           # exponent 8
    (0.5, 0x30),
    (3.0, 0x44),            # 2 * 1.1b
    (240.0, 0x77),          # 2^7 * 1.111b
    (256.0, 0x78),
    (448.0, 0x7E),          # 2^8 * 1.110b, the largest finite value
    (-448.0, 0xFE),
    (2.0 ** -6, 0x08),      # smallest normal
    (2.0 ** -9, 0x01),      # smallest subnormal (0.001b * 2^-6)
    (7 * 2.0 ** -9, 0x07),  # largest subnormal
]


def test_exported_from_package():
    assert "fp8" in cupaged.__all__
    assert cupaged.fp8 is fp8
    assert fp8.E4M3_MAX == 448.0


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16, ml_dtypes.bfloat16])
def test_known_bit_patterns(dtype):
    values = np.array([v for v, _ in KNOWN], dtype=np.float64)
    want = np.array([b for _, b in KNOWN], dtype=np.uint8)
    x = values.astype(dtype)
    assert np.array_equal(x.astype(np.float64), values)  # every value exact in every dtype
    bits = fp8.to_e4m3(x)
    assert bits.dtype == np.uint8 and bits.shape == x.shape
    np.testing.assert_array_equal(bits, want)
    back = fp8.from_e4m3(want)
    assert back.dtype == np.float32
    np.testing.assert_array_equal(back, values.astype(np.float32))
    assert np.signbit(back[1]) and not np.signbit(back[0])  # -0 kept


def test_saturation_and_nan():
    bits = fp8.to_e4m3(np.array([1000.0, -1000.0, 449.0, 464.0, 1e30, -np.inf, np.inf]))
    np.testing.assert_array_equal(bits, [0x7E, 0xFE, 0x7E, 0x7E, 0x7E, 0xFE, 0x7E])
    np.testing.assert_array_equal(fp8.from_e4m3(bits)[:2], [448.0, -448.0])
    nan_bits = fp8.to_e4m3(np.array([np.nan]))
    assert int(nan_bits[0]) & 0x7F == 0x7F
    out = fp8.from_e4m3(np.array([0x7F, 0xFF], np.uint8))
    assert np.isnan(out).all()


def test_round_to_nearest_even():
    # between 1.0 (0x38) and 1.125 (0x39): the midpoint 1.0625 goes to the even 0x38,
    # just above it to 0x39; between 1.125 and 1.25 (0x3a) the midpoint goes to 0x3a
    x = np.array([1.0625, 1.0625 + 1e-6, 1.1875, 1.1875 - 1e-6, 1.03])
    np.testing.assert_array_equal(fp8.to_e4m3(x), [0x38, 0x39, 0x3A, 0x39, 0x38])


def test_round_trip_error_bound():
    rng = np.random.default_rng(0)
    # normal range [2^-6, 448]: relative error <= 2^-4 (3 mantissa bits, round to nearest)
    mag = np.exp2(rng.uniform(-6, np.log2(448), size=20000))
    x = mag * rng.choice([-1.0, 1.0], size=mag.shape)
    back = fp8.from_e4m3(fp8.to_e4m3(x)).astype(np.float64)
    rel = np.abs(back - x) / np.abs(x)
    assert rel.max() <= 2.0 ** -4 + 1e-12
    assert rel.max() > 2.0 ** -5  # the bound is nearly reached (the test can fail)
    # subnormals: absolute error <= half the spacing 2^-9
    tiny = rng.uniform(-(2.0 ** -6), 2.0 ** -6, size=5000)
    back = fp8.from_e4m3(fp8.to_e4m3(tiny)).astype(np.float64)
    assert np.abs(back - tiny).max() <= 2.0 ** -10 + 1e-15
    # with a scale the error is relative to the scaled range
    big = rng.standard_normal(5000) * 1e4
    scale = float(np.abs(big).max()) / fp8.E4M3_MAX
    back = fp8.from_e4m3(fp8.to_e4m3(big, scale), scale).astype(np.float64)
    normal = np.abs(big) / scale >= 2.0 ** -6
    assert (np.abs(back - big)[normal] / np.abs(big)[normal]).max() <= 2.0 ** -4 + 1e-6


def test_agrees_with_ml_dtypes_float8():
    rng = np.random.default_rng(1)
    x = rng.standard_normal(4096) * 50
    bits = fp8.to_e4m3(x)
    np.testing.assert_array_equal(bits, x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
    # from_e4m3 takes an ml_dtypes array as well as uint8 bits
    f8 = bits.view(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(fp8.from_e4m3(f8), fp8.from_e4m3(bits))
    np.testing.assert_array_equal(fp8.from_e4m3(bits), f8.astype(np.float32))


def test_per_tensor_scale():
    x = np.array([1.0, -3.0, 10.0])
    np.testing.assert_array_equal(fp8.to_e4m3(x, 0.5), fp8.to_e4m3(2 * x))
    np.testing.assert_array_equal(fp8.from_e4m3(fp8.to_e4m3(x, 0.25), 0.25), x)
    np.testing.assert_array_equal(fp8.to_e4m3(x, np.float32(2.0)), fp8.to_e4m3(x / 2))
    np.testing.assert_array_equal(fp8.to_e4m3(x, np.array(2.0)), fp8.to_e4m3(x / 2))  # 0-d = per tensor


@pytest.mark.parametrize("head_axis", [2, 1, -2])
def test_per_head_scale_broadcast(head_axis):
    rng = np.random.default_rng(2)
    shape = (3, 4, 5, 8)  # the heads run along head_axis
    axis = head_axis % 4
    x = rng.standard_normal(shape)
    scale = np.array([0.5, 2.0, 4.0, 0.125, 1.0][: shape[axis]], dtype=np.float32)
    bits = fp8.to_e4m3(x, scale, head_axis=head_axis)
    for h in range(shape[axis]):
        sl = [slice(None)] * 4
        sl[axis] = h
        sl = tuple(sl)
        np.testing.assert_array_equal(bits[sl], fp8.to_e4m3(x[sl] / float(scale[h])))
        np.testing.assert_array_equal(
            fp8.from_e4m3(bits, scale, head_axis=head_axis)[sl],
            fp8.from_e4m3(bits[sl]) * scale[h])


def test_bad_scales_raise():
    x = np.zeros((2, 3, 4))
    with pytest.raises(ShapeError, match="3 heads"):
        fp8.to_e4m3(x, np.ones(4), head_axis=1)
    with pytest.raises(ShapeError):
        fp8.from_e4m3(np.zeros((2, 3, 4), np.uint8), np.ones(2), head_axis=-1)
    with pytest.raises(ShapeError, match="1-D"):
        fp8.to_e4m3(x, np.ones((3, 1)), head_axis=1)
    with pytest.raises(InvalidArgumentError, match="head_axis"):
        fp8.to_e4m3(x, np.ones(3))  # per-head scale without an axis
    with pytest.raises(InvalidArgumentError, match="head_axis"):
        fp8.to_e4m3(x, np.ones(3), head_axis=3)
    for bad in (0.0, np.inf, np.nan):
        with pytest.raises(InvalidArgumentError, match="finite and nonzero"):
            fp8.to_e4m3(x, bad)
    with pytest.raises(InvalidArgumentError, match="finite and nonzero"):
        fp8.to_e4m3(x, np.array([1.0, 0.0, 1.0]), head_axis=1)
    with pytest.raises(DTypeError):
        fp8.to_e4m3(x, np.array(["a", "b", "c"]), head_axis=1)
    with pytest.raises(DTypeError, match="uint8"):
        fp8.from_e4m3(np.zeros(3, np.int8))
    with pytest.raises(DTypeError):
        fp8.to_e4m3(np.array(["x"]))
    # every one of these is a ValueError, like the rest of cupaged's bad values
    assert issubclass(ShapeError, ValueError) and issubclass(DTypeError, ValueError)


def test_cupy_in_cupy_out():
    cp = pytest.importorskip("cupy")
    if not cupaged.has_gpu():
        pytest.skip("no CUDA GPU on this machine")
    x = np.linspace(-500, 500, 64).reshape(2, 4, 8)
    scale = np.array([1.0, 2.0, 0.5, 4.0], np.float32)
    bits = fp8.to_e4m3(cp.asarray(x), cp.asarray(scale), head_axis=1)
    assert isinstance(bits, cp.ndarray) and bits.dtype == cp.uint8
    np.testing.assert_array_equal(bits.get(), fp8.to_e4m3(x, scale, head_axis=1))
    back = fp8.from_e4m3(bits, scale, head_axis=1)
    assert isinstance(back, cp.ndarray) and back.dtype == cp.float32
    np.testing.assert_array_equal(back.get(), fp8.from_e4m3(bits.get(), scale, head_axis=1))
