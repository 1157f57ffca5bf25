"""Arithmetic in GF(2^8), the field the erasure code works in.

Elements are bytes. Addition is XOR; multiplication is polynomial multiplication modulo the
primitive polynomial x^8 + x^4 + x^3 + x^2 + 1 (0x11D, the one Backblaze's JavaReedSolomon,
klauspost/reedsolomon and most storage RS codes use), for which 2 generates the
multiplicative group. So every non-zero byte is ``EXP[i]`` for one ``i`` in 0..254, and
``a * b = EXP[LOG[a] + LOG[b]]``.

Three layers:

- tables and scalar ops (``EXP``, ``LOG``, ``MUL``, ``INV``, ``mul``, ``inv``);
- small matrices over the field (host NumPy, a few dozen entries): ``matmul``, ``invert``;
- bulk "region" ops on large uint8 arrays with an ``xp`` module (NumPy or CuPy), which is where
  the time goes: ``xor_into`` (``acc ^= x``), ``mul_into`` (``out = c * x``) and
  ``mul_xor_into`` (``acc ^= c * x``). On NumPy they gather from a product table; on CuPy
  they run as a small elementwise CUDA kernel reading the 256x256 table from device memory.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

POLY = 0x11D
GENERATOR = 2


class SingularMatrixError(ValueError):
    """The matrix has no inverse over GF(2^8)."""


def _build_exp_log() -> tuple[np.ndarray, np.ndarray]:
    exp = np.zeros(510, dtype=np.uint8)  # doubled, so EXP[LOG[a] + LOG[b]] needs no "mod 255"
    log = np.zeros(256, dtype=np.int32)  # LOG[0] is undefined; callers handle 0 first
    x = 1
    for i in range(255):
        exp[i] = x
        log[x] = i
        x <<= 1
        if x & 0x100:
            x ^= POLY
    exp[255:] = exp[:255]
    return exp, log


EXP, LOG = _build_exp_log()


def _build_mul() -> np.ndarray:
    a = np.arange(256)[:, None]
    b = np.arange(256)[None, :]
    table = EXP[LOG[a] + LOG[b]]
    table[(a == 0) | (b == 0)] = 0
    return np.ascontiguousarray(table, dtype=np.uint8)


MUL = _build_mul()  # MUL[a, b] = a * b: 64 KiB, the only table the bulk ops need
INV = np.zeros(256, dtype=np.uint8)  # INV[a] * a == 1 for a != 0; INV[0] stays 0 (undefined)
INV[1:] = EXP[255 - LOG[1:]]
for _table in (EXP, LOG, MUL, INV):
    _table.flags.writeable = False


def mul(a: int, b: int) -> int:
    return int(MUL[a, b])


def inv(a: int) -> int:
    if a == 0:
        raise ZeroDivisionError("0 has no inverse in GF(2^8)")
    return int(INV[a])


# ---------------------------------------------------------------------------------------------
# Small matrices (host only: coding and decoding matrices are at most 255 x 255 and built once).


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Matrix product over GF(2^8) of uint8 matrices [n, m] @ [m, p]."""
    a = np.asarray(a, dtype=np.uint8)
    b = np.asarray(b, dtype=np.uint8)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"cannot multiply matrices of shapes {a.shape} and {b.shape}")
    products = MUL[a[:, :, None], b[None, :, :]]  # [n, m, p]: every a[i, t] * b[t, j]
    return np.bitwise_xor.reduce(products, axis=1, initial=0).astype(np.uint8)


def invert(matrix: np.ndarray) -> np.ndarray:
    """Inverse of a square uint8 matrix over GF(2^8) by Gauss-Jordan elimination."""
    a = np.array(matrix, dtype=np.uint8)
    n = a.shape[0]
    if a.ndim != 2 or a.shape[1] != n:
        raise ValueError(f"only square matrices have an inverse, got shape {a.shape}")
    work = np.concatenate([a, np.eye(n, dtype=np.uint8)], axis=1)  # [A | I] -> [I | A^-1]
    for col in range(n):
        nonzero = np.flatnonzero(work[col:, col])
        if nonzero.size == 0:
            raise SingularMatrixError(f"matrix is singular over GF(2^8) (no pivot in column {col})")
        pivot = col + int(nonzero[0])
        if pivot != col:
            work[[col, pivot]] = work[[pivot, col]]
        work[col] = MUL[INV[work[col, col]], work[col]]  # scale the pivot row to a leading 1
        factors = work[:, col].copy()
        factors[col] = 0
        # Eliminate the column from every other row at once: row ^= factor * pivot_row.
        work ^= MUL[factors[:, None], work[col][None, :]]
    return work[:, n:].copy()


# ---------------------------------------------------------------------------------------------
# Bulk region ops. Arguments are C-contiguous uint8 arrays of equal size (any shape); ``acc`` and
# ``out`` are written in place. ``c`` is a Python int in 0..255.

# NumPy has no byte shuffle, so "c * x" is a gather from a table. Gathering 16-bit pairs from a
# 65536-entry table (T16[c][hi << 8 | lo] = MUL[c][hi] << 8 | MUL[c][lo], valid in either byte
# order) halves the number of gathers; blocks of 64 Ki pairs keep the temporaries in L2 cache;
# mode="clip" (a uint16 index is always in range) spares NumPy's bounds check and output buffer.
# benchmarks/erasure.py measures it.
_NUMPY_BLOCK = 1 << 16


@functools.lru_cache(maxsize=256)
def _pair_table(c: int) -> np.ndarray:
    row = MUL[c].astype(np.uint16)
    table = ((row[:, None] << 8) | row[None, :]).ravel()
    table.flags.writeable = False
    return table


def _is_numpy(xp: Any) -> bool:
    return xp is np


def _flat(a: Any) -> Any:
    return a.reshape(-1)  # a view for the C-contiguous arrays the callers pass


def _numpy_mul(target: np.ndarray, c: int, x: np.ndarray, accumulate: bool) -> None:
    target, x = _flat(target), _flat(x)
    pairs = x.size // 2
    t16 = _pair_table(c)
    x16 = x[: 2 * pairs].view(np.uint16)
    target16 = target[: 2 * pairs].view(np.uint16)
    scratch = np.empty(min(_NUMPY_BLOCK, pairs), dtype=np.uint16) if accumulate else None
    for start in range(0, pairs, _NUMPY_BLOCK):
        stop = min(start + _NUMPY_BLOCK, pairs)
        if accumulate:
            block = scratch[: stop - start]
            np.take(t16, x16[start:stop], out=block, mode="clip")
            np.bitwise_xor(target16[start:stop], block, out=target16[start:stop])
        else:
            np.take(t16, x16[start:stop], out=target16[start:stop], mode="clip")
    if x.size % 2:  # an odd trailing byte
        product = MUL[c, x[-1]]
        target[-1] = target[-1] ^ product if accumulate else product


# CuPy: one thread per 32-bit word does four byte lookups in the 256x256 table (64 KiB, served
# from L1/L2), so loads and stores stay 4-byte coalesced. A byte-per-thread twin handles sizes
# or addresses that are not multiples of 4 (never the case for float32 rows).
_CUDA_WORD = """
    const int base = c << 8;
    const unsigned int y = (unsigned int)table[base + (x & 0xFFu)]
        | ((unsigned int)table[base + ((x >> 8) & 0xFFu)] << 8)
        | ((unsigned int)table[base + ((x >> 16) & 0xFFu)] << 16)
        | ((unsigned int)table[base + (x >> 24)] << 24);
"""


@functools.cache
def _cupy_kernel(word: bool, accumulate: bool) -> Any:
    import cupy

    op = "^=" if accumulate else "="
    if word:
        params, body = "uint32 x, raw uint8 table, int32 c", _CUDA_WORD + f"acc {op} y;"
        out = "uint32 acc"
    else:
        params, body = "uint8 x, raw uint8 table, int32 c", f"acc {op} table[(c << 8) + x];"
        out = "uint8 acc"
    name = f"dlrmflow_gf256_mul{'_xor' if accumulate else ''}_{'u32' if word else 'u8'}"
    return cupy.ElementwiseKernel(params, out, body, name)


_device_tables: dict[int, Any] = {}


def _cupy_table(xp: Any) -> Any:
    device = xp.cuda.Device().id
    if device not in _device_tables:
        _device_tables[device] = xp.asarray(MUL.ravel())
    return _device_tables[device]


def _cupy_mul(xp: Any, target: Any, c: int, x: Any, accumulate: bool) -> None:
    target, x = _flat(target), _flat(x)
    word = x.size % 4 == 0 and x.data.ptr % 4 == 0 and target.data.ptr % 4 == 0
    if word:
        target, x = target.view(xp.uint32), x.view(xp.uint32)
    _cupy_kernel(word, accumulate)(x, _cupy_table(xp), c, target)


def _check_region(target: Any, x: Any) -> None:
    if target.dtype != np.uint8 or x.dtype != np.uint8:
        raise TypeError(f"GF(2^8) region ops take uint8 arrays, got {target.dtype} and {x.dtype}")
    if target.shape != x.shape:
        raise ValueError(f"GF(2^8) region ops need equal shapes, got {target.shape} and {x.shape}")
    if not (target.flags.c_contiguous and x.flags.c_contiguous):
        raise ValueError("GF(2^8) region ops need C-contiguous arrays (they work on flat views)")


def xor_into(acc: Any, x: Any, xp: Any = np) -> None:
    """``acc ^= x`` (addition in GF(2^8), and the whole of the r = 1 code)."""
    _check_region(acc, x)
    xp.bitwise_xor(acc, x, out=acc)


def mul_into(out: Any, c: int, x: Any, xp: Any = np) -> None:
    """``out = c * x`` byte by byte."""
    _check_region(out, x)
    if c == 0:
        out.fill(0)
    elif c == 1:
        xp.copyto(out, x)
    elif _is_numpy(xp):
        _numpy_mul(out, c, x, accumulate=False)
    else:
        _cupy_mul(xp, out, c, x, accumulate=False)


def mul_xor_into(acc: Any, c: int, x: Any, xp: Any = np) -> None:
    """``acc ^= c * x`` byte by byte: the multiply-accumulate that encode, delta and decode use."""
    _check_region(acc, x)
    if c == 0:
        return
    if c == 1:
        xp.bitwise_xor(acc, x, out=acc)
    elif _is_numpy(xp):
        _numpy_mul(acc, c, x, accumulate=True)
    else:
        _cupy_mul(xp, acc, c, x, accumulate=True)
