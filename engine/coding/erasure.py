"""A systematic erasure code over the bit patterns of embedding rows.

Data model. Data shard ``i`` (of ``k``) holds a 2-D array ``[n_rows_i, row_width]`` (float32
weights + optimizer state in dlrmflow; any dtype works). Stripe ``j`` is local row ``j`` of every
data shard; a shard with fewer rows contributes zero bytes to the stripes past its end. Parity
shard ``p`` (of ``r``) holds ``max_i n_rows_i`` rows of the same dtype and width whose bytes are

    parity_p[j] = XOR_i  C[p, i] * data_i[j]        (byte by byte, * in GF(2^8))

The code works on raw bytes (``.view(uint8)``), never on values, so every NaN payload, +-Inf,
denormal and -0.0 comes back bit for bit. (ECRec encodes float sums and tolerates drift; a
recovered model here is bit-identical to the lost one.)

The coding matrix C (r x k) is a Cauchy matrix with its columns scaled so that row 0 is all
ones:

    C[p, i] = (x_0 + y_i) / (x_p + y_i),   x_p = p,  y_i = r + i,   (+ is XOR; all distinct)

Why every erasure of up to r shards is decodable. The generator G = [I_k ; C] maps the k data
bytes of a stripe to its k + r shard bytes. Decoding from a set S of k surviving shards means
inverting G_S (the k rows of G in S). Expand det G_S along its identity rows (the surviving data
shards): what is left is, up to sign, the determinant of the m x m submatrix of C with the
surviving parity rows and the lost data columns (m = number of lost data shards). Every square
submatrix of a Cauchy matrix is non-singular (its determinant is a product of non-zero
differences), and scaling columns by non-zero constants keeps it so. Hence det G_S != 0 for
every S, i.e. the code is MDS: any k shards rebuild the rest. ``tests/test_erasure.py`` checks
this exhaustively for k <= 12, r <= 4.

Row 0 being all ones makes parity 0 a plain XOR, so r = 1 *is* XOR parity, and for r >= 2 the
common single-failure rebuild (one data shard, from parity 0) is XOR only.

Updates are linear: when data row ``j`` of shard ``i`` changes from ``old`` to ``new``, parity p
changes by ``C[p, i] * (old ^ new)``, and the changes of one stripe from several shards, and
successive changes of one row, simply XOR together: :meth:`ErasureCode.combine_changes` turns the
row changes (:func:`xor_bits`) of any number of write-back batches into one message per parity
shard, which :meth:`ErasureCode.apply_delta` XORs into it.

Reads of lost rows. A degraded read gathers the wanted stripes from k survivors
(:meth:`ErasureCode.survivors_for`, :func:`gather_stripes`) and decodes them
(:meth:`ErasureCode.decode`); a rebuild does the same over whole chunks of stripes
(:func:`stripe_chunks`), with ``n_rows`` cutting a short data shard's rows.

Every bulk operation takes ``xp`` (NumPy or CuPy); arrays stay on that module's device.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from numbers import Integral
from typing import Any

import numpy as np

from dlrmflow.engine.coding import gf256
from dlrmflow.engine.errors import UserInputError

MAX_PARITY = 4
MAX_SHARDS = 255


class TooManyErasuresError(UserInputError):
    """More shards are missing than the code can rebuild.

    An MDS code with more than r erasures determines none of the lost shards: the surviving
    parity gives fewer equations than there are lost data shards, and every square submatrix of
    C is invertible, so each lost byte (data or parity) can still take any value.
    """

    def __init__(self, k: int, r: int, lost: Sequence[int], survivors: Sequence[int]):
        self.k, self.r = k, r
        self.lost = sorted(lost)
        self.survivors = sorted(survivors)
        super().__init__(
            f"{len(self.lost)} of {k + r} shards are lost ({_describe(self.lost, k)}), but a k={k}, r={r} "
            f"erasure code rebuilds at most {r}: none of the lost shards can be recovered; "
            f"the survivors ({_describe(self.survivors, k)}) hold their own rows intact"
        )

    def __reduce__(self) -> tuple:  # so it survives pickling, e.g. on its way back from a Dask worker
        return (type(self), (self.k, self.r, self.lost, self.survivors))


def _describe(shards: Sequence[int], k: int) -> str:
    data = [str(s) for s in shards if s < k]
    parity = [s for s in shards if s >= k]
    parts = [f"data shards {', '.join(data)}"] if data else []
    if parity:
        parities = ", ".join(str(s - k) for s in parity)
        parts.append(f"parity shards {parities} (shard indices {', '.join(map(str, parity))})")
    return "; ".join(parts) or "none"


@functools.cache
def coding_matrix(k: int, r: int) -> np.ndarray:
    """The r x k coding matrix C (uint8, read-only): see the module docstring."""
    x = np.arange(r)[:, None]
    y = (r + np.arange(k))[None, :]
    cauchy = gf256.INV[x ^ y]  # 1 / (x_p + y_i); x_p != y_i because k + r <= 256
    matrix = gf256.MUL[cauchy, gf256.INV[cauchy[0]][None, :]]  # column i scaled by 1 / cauchy[0, i]
    matrix.flags.writeable = False
    return matrix


@functools.cache
def generator_matrix(k: int, r: int) -> np.ndarray:
    """G = [I_k ; C], (k + r) x k: shard s of a stripe is G[s] . (the stripe's k data bytes)."""
    g = np.concatenate([np.eye(k, dtype=np.uint8), coding_matrix(k, r)])
    g.flags.writeable = False
    return g


@functools.lru_cache(maxsize=1024)
def decoding_matrix(k: int, r: int, survivors: tuple[int, ...], targets: tuple[int, ...]) -> np.ndarray:
    """Row t: coefficients that rebuild shard ``targets[t]`` from the shards ``survivors`` (k of them).

    data = G_S^-1 . survivors, so shard s = G[s] . G_S^-1 . survivors. Cached: a recovery and its
    degraded reads decode many chunks with the same erasure pattern.
    """
    g = generator_matrix(k, r)
    rows = gf256.matmul(g[list(targets)], gf256.invert(g[list(survivors)]))
    rows.flags.writeable = False
    return rows


@dataclass(frozen=True)
class StripeDelta:
    """The combined parity change of a batch of row changes: one message per parity shard.

    Parity shard p applies it with ``code.apply_delta(parity_p, delta.parity[p], rows=delta.stripes)``.
    """

    stripes: Any  # sorted unique stripe indices (int64), on the device of xp
    parity: list[Any]  # parity[p]: [len(stripes), row_width] bytes to XOR into parity shard p


def _check_index(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise UserInputError(f"{what} must be an integer, got {value!r}")
    return int(value)


def _bytes(a: Any, what: str, xp: Any) -> Any:
    """A C-contiguous uint8 view of ``a`` (its last axis becomes itemsize times longer)."""
    if getattr(a, "ndim", 0) < 1:
        raise UserInputError(f"{what} must be an array with at least one axis, got {type(a).__name__}")
    return xp.ascontiguousarray(a).view(xp.uint8)


def _check_rows(arrays: Mapping[str, Any]) -> tuple[np.dtype, tuple[int, ...]]:
    """All arrays are 2-D [rows, width] of one dtype and width; return (dtype, row shape)."""
    dtype = row_shape = None
    for what, a in arrays.items():
        if getattr(a, "ndim", None) != 2:
            raise UserInputError(
                f"{what} must be a 2-D array [rows, row_width], got {getattr(a, 'shape', a)!r}"
            )
        if a.shape[1] == 0:
            raise UserInputError(f"{what} has rows of width 0")
        if dtype is None:
            dtype, row_shape, first = a.dtype, a.shape[1:], what
        elif a.dtype != dtype or a.shape[1:] != row_shape:
            raise UserInputError(
                f"{what} has rows of {a.dtype} x {a.shape[1]} but {first} has {dtype} x {row_shape[0]}; "
                "all shards of a code must share dtype and row width"
            )
    return dtype, row_shape


def _as_rows(a: Any, dtype: np.dtype) -> Any:
    return a.view(dtype)  # uint8 [n, width * itemsize] -> dtype [n, width], no copy


def _words(a: Any, xp: Any) -> Any:
    """A C-contiguous view of 2-D rows as unsigned words of their item size (uint8 for odd sizes):
    XOR in words touches 4x fewer elements than bytes for float32, over the same memory."""
    a = xp.ascontiguousarray(a)
    size = a.dtype.itemsize
    return a.view(np.dtype(f"u{size}") if size in (1, 2, 4, 8) else np.dtype(np.uint8))


def xor_bits(old: Any, new: Any, xp: Any = np) -> Any:
    """``old ^ new`` over the bit patterns of two row arrays, in their dtype (a row's change)."""
    if old.shape != new.shape or old.dtype != new.dtype:
        raise UserInputError(
            f"old and new rows differ in shape or dtype: {old.dtype} {old.shape} vs {new.dtype} {new.shape}"
        )
    return xp.bitwise_xor(_words(old, xp), _words(new, xp)).view(old.dtype)


def _index_array(rows: Any, what: str, xp: Any, unique: bool = True) -> Any:
    rows = xp.asarray(rows)
    if rows.ndim != 1 or not (rows.size == 0 or rows.dtype.kind in "iu"):
        raise UserInputError(
            f"{what} must be a 1-D array of integer row indices, got {rows.dtype} {rows.shape}"
        )
    rows = rows.astype(xp.int64, copy=False)
    if unique and _has_duplicates(rows, xp):
        raise UserInputError(f"{what} repeats a row index; each row may appear once per update")
    return rows


def _has_duplicates(rows: Any, xp: Any) -> bool:
    if rows.size < 2 or bool((rows[1:] > rows[:-1]).all()):  # strictly increasing: the common case
        return False
    ordered = xp.sort(rows)
    return bool((ordered[1:] == ordered[:-1]).any())


@dataclass(frozen=True)
class ErasureCode:
    """A systematic (k + r, k) MDS code: k data shards, r parity shards (1 <= r <= 4).

    Shard indices: 0..k-1 are the data shards, k..k+r-1 the parity shards.
    """

    k: int
    r: int

    def __post_init__(self) -> None:
        k = _check_index(self.k, "the number of data shards k")
        r = _check_index(self.r, "the number of parity shards r")
        if k < 1:
            raise UserInputError(f"an erasure code needs at least one data shard, got k={k}")
        if not 1 <= r <= MAX_PARITY:
            raise UserInputError(
                f"the number of parity shards r must be between 1 and {MAX_PARITY}, got r={r}"
            )
        if k + r > MAX_SHARDS:
            raise UserInputError(
                f"k + r = {k + r} shards is more than GF(2^8) codes support ({MAX_SHARDS}); use fewer shards"
            )
        object.__setattr__(self, "k", k)
        object.__setattr__(self, "r", r)

    @property
    def n_shards(self) -> int:
        return self.k + self.r

    @property
    def matrix(self) -> np.ndarray:
        """The r x k coding matrix C (host uint8, read-only)."""
        return coding_matrix(self.k, self.r)

    def coefficient(self, parity: int, shard: int) -> int:
        return int(self.matrix[parity, shard])

    # -- encode and verify ----------------------------------------------------------------------

    def encode(self, data: Sequence[Any], xp: Any = np) -> list[Any]:
        """The r parity shards of ``k`` data shards, each ``[max rows, width]`` in the data's dtype."""
        if len(data) != self.k:
            raise UserInputError(f"encode takes the k={self.k} data shards, got {len(data)}")
        dtype, _ = _check_rows({f"data shard {i}": d for i, d in enumerate(data)})
        shards = [_bytes(d, f"data shard {i}", xp) for i, d in enumerate(data)]
        n_stripes = max(s.shape[0] for s in shards)
        parity = []
        for p in range(self.r):
            acc = xp.zeros((n_stripes, shards[0].shape[1]), dtype=xp.uint8)
            for i, shard in enumerate(shards):
                gf256.mul_xor_into(acc[: shard.shape[0]], self.coefficient(p, i), shard, xp)
            parity.append(_as_rows(acc, dtype))
        return parity

    def verify(self, data: Sequence[Any], parity: Sequence[Any], xp: Any = np) -> list[np.ndarray]:
        """Re-encode ``data`` and compare with ``parity`` bit for bit.

        Returns, per parity shard, the (host) indices of the stripes that differ: all empty means
        the parity is consistent with the data.
        """
        if len(parity) != self.r:
            raise UserInputError(f"verify takes the r={self.r} parity shards, got {len(parity)}")
        expected = self.encode(data, xp)
        _check_rows({"data shard 0": data[0], **{f"parity shard {p}": a for p, a in enumerate(parity)}})
        mismatches = []
        for p, (want, have) in enumerate(zip(expected, parity, strict=True)):
            if have.shape != want.shape:
                raise UserInputError(
                    f"parity shard {p} has {have.shape[0]} rows "
                    f"but the data shards make {want.shape[0]} stripes"
                )
            differs = (_bytes(want, "parity", xp) != _bytes(have, f"parity shard {p}", xp)).any(axis=1)
            mismatches.append(np.asarray(_to_host(xp.flatnonzero(differs))))
        return mismatches

    # -- updates --------------------------------------------------------------------------------

    def combine_changes(self, shards: Any, rows: Any, changes: Any, xp: Any = np) -> StripeDelta:
        """The parity change of a sequence of row changes: one row per touched stripe and parity shard.

        Change ``n``: row ``rows[n]`` of data shard ``shards[n]`` went from ``old`` to ``new``, and
        ``changes[n]`` is ``old ^ new`` (:func:`xor_bits`). The changes may come from many write-back
        batches in any order, and a row may change several times: the code is linear and
        ``(a ^ b) ^ (b ^ c) = a ^ c``, so they compose. Applying the result equals applying, one change
        at a time, ``C[p, shards[n]] * changes[n]`` to stripe ``rows[n]`` of every parity shard ``p``.
        """
        shards = _index_array(shards, "change shards", xp, unique=False)
        rows = _index_array(rows, "change rows", xp, unique=False)
        dtype, _ = _check_rows({"changes": changes})
        if not shards.size == rows.size == changes.shape[0]:
            raise UserInputError(
                f"{shards.size} shard indices, {rows.size} row indices and {changes.shape[0]} changed rows: "
                "combine_changes needs one of each per change"
            )
        if rows.size and (int(rows.min()) < 0 or int(shards.min()) < 0 or int(shards.max()) >= self.k):
            raise UserInputError(f"a change names a negative row or a data shard outside 0..{self.k - 1}")
        changes = _words(changes, xp)
        # Sort the changes by stripe; the L-th change of each stripe (its rank) touches a stripe no
        # other change of rank L touches, so each rank is one scatter that loses no write (CuPy has
        # no ``bitwise_xor.at``/``reduceat``). Ranks are few: K data shards per stripe, plus the
        # rows that several batches of one message wrote.
        order = xp.argsort(rows)
        ordered = rows[order]
        first = xp.ones(ordered.size, dtype=bool)
        first[1:] = ordered[1:] != ordered[:-1]
        starts = xp.flatnonzero(first)
        group = xp.cumsum(first) - 1
        rank = xp.arange(ordered.size) - starts[group]
        depth = int(rank.max()) + 1 if rank.size else 0
        by_rank = [xp.flatnonzero(rank == level) for level in range(1, depth)]
        changes, shards = changes[order], shards[order]
        parity = []
        for p in range(self.r):
            product = self._times_coefficients(p, shards, changes, xp)
            acc = product[starts]  # rank 0: every stripe's first change (a copy)
            for at in by_rank:
                acc[group[at]] ^= product[at]
            parity.append(acc.view(dtype))
        return StripeDelta(stripes=ordered[starts], parity=parity)

    def _times_coefficients(self, p: int, shards: Any, changes: Any, xp: Any) -> Any:
        """``C[p, shards[n]] * changes[n]`` for every change (bytes); one multiply per data shard."""
        coefficients = [self.coefficient(p, i) for i in range(self.k)]
        if all(c == 1 for c in coefficients):  # parity 0 (all ones), so all of r = 1
            return changes
        out = xp.empty_like(changes)
        for i, c in enumerate(coefficients):
            at = xp.flatnonzero(shards == i)
            if at.size:
                part = xp.empty_like(changes[at])
                gf256.mul_into(part.view(xp.uint8), c, xp.ascontiguousarray(changes[at]).view(xp.uint8), xp)
                out[at] = part
        return out

    def apply_delta(self, parity: Any, delta: Any, xp: Any = np, *, rows: Any = None) -> None:
        """``parity ^= delta`` in place (bytes), on all rows or on ``rows`` (unique indices or a slice)."""
        if parity.dtype != delta.dtype:
            raise UserInputError(f"parity is {parity.dtype} but the delta is {delta.dtype}")
        target = parity.view(xp.uint8)  # a view, so the XOR lands in ``parity``
        if rows is not None and not isinstance(rows, slice):
            idx = _index_array(rows, "delta rows", xp)
            if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= parity.shape[0]):
                raise UserInputError(
                    f"delta rows must lie in 0..{parity.shape[0] - 1} (the parity shard's stripes), "
                    f"got {int(idx.min())}..{int(idx.max())}"
                )
            if delta.shape != (idx.size, *parity.shape[1:]):
                raise UserInputError(
                    f"a delta for {idx.size} rows must have shape "
                    f"{(idx.size, *parity.shape[1:])}, got {delta.shape}"
                )
            target[idx] ^= _bytes(delta, "delta", xp)
            return
        if rows is not None:
            target = target[rows]
        if target.shape != _bytes(delta, "delta", xp).shape:
            raise UserInputError(f"delta of shape {delta.shape} does not match the parity rows it updates")
        xp.bitwise_xor(target, _bytes(delta, "delta", xp), out=target)

    # -- decode ---------------------------------------------------------------------------------

    def survivors_for(self, available: Sequence[int]) -> tuple[int, ...]:
        """The k shards a decode reads, out of ``available``: data shards first, then parity in order.

        Data shards have identity rows (cheap) and parity 0 is plain XOR, so this choice keeps the
        most decoding coefficients at 0 or 1.
        """
        ids = sorted({self._shard(s) for s in available})
        missing = sorted(set(range(self.n_shards)) - set(ids))
        if len(missing) > self.r:
            raise TooManyErasuresError(self.k, self.r, missing, ids)
        return tuple(([s for s in ids if s < self.k] + [s for s in ids if s >= self.k])[: self.k])

    def decode(
        self,
        available: Mapping[int, Any],
        lost: Sequence[int],
        xp: Any = np,
        *,
        n_rows: Mapping[int, int] | None = None,
    ) -> dict[int, Any]:
        """Rebuild the shards ``lost`` (data and/or parity indices) from any k of ``available``.

        ``available`` maps shard index -> its rows for the stripes being decoded; all arrays must
        start at the same stripe (whole shards, one chunk of stripes, or the rows a degraded read
        gathered with :func:`gather_stripes`); shorter arrays are zero-padded logically. A rebuilt
        shard has as many rows as the longest array read, unless ``n_rows`` gives a lost data
        shard's own (shorter) row count. More than r shards missing raises
        :class:`TooManyErasuresError`.
        """
        lost = [self._shard(s) for s in lost]
        if len(set(lost)) != len(lost):
            raise UserInputError(f"lost shards {lost} repeat an index")
        both = sorted(set(lost) & set(available))
        if both:
            raise UserInputError(f"shards {both} are listed both as available and as lost")
        self.survivors_for(list(available))  # raises when more than r shards are missing
        if not lost:
            return {}
        dtype, _ = _check_rows({f"shard {s}": available[s] for s in sorted(available)})
        shards = {s: _bytes(a, f"shard {s}", xp) for s, a in available.items()}
        n_stripes = max(a.shape[0] for a in shards.values())
        row_bytes = next(iter(shards.values())).shape[1]
        out_rows = {s: n_stripes if n_rows is None else n_rows.get(s, n_stripes) for s in lost}
        for s, n in out_rows.items():
            if not 0 <= n <= n_stripes:
                raise UserInputError(f"n_rows[{s}] = {n} is outside 0..{n_stripes} (the stripes read)")
        # One target at a time, data shards first, each from the best k shards at hand *including
        # the ones just rebuilt*: the last lost data shard then comes from parity 0 by XOR alone, and
        # a lost parity shard is re-encoded from complete data. For two lost data shards that is k
        # GF multiplications instead of 2k when every target is decoded from the original survivors.
        for target in sorted(lost, key=lambda s: (s >= self.k, s)):
            survivors = self.survivors_for(list(shards))
            (coefficients,) = decoding_matrix(self.k, self.r, survivors, (target,))
            terms = sorted(zip(coefficients.tolist(), survivors, strict=True),
                           key=lambda term: shards[term[1]].shape[0] < n_stripes)
            # The first full-length term sets the sum (a copy for c = 1), the others add to it: one
            # pass over the bytes fewer than zeroing first (a rebuild decodes whole chunks).
            c, s = terms[0]
            if shards[s].shape[0] == n_stripes:
                acc = xp.empty((n_stripes, row_bytes), dtype=xp.uint8)
                gf256.mul_into(acc, c, shards[s], xp)
                terms = terms[1:]
            else:
                acc = xp.zeros((n_stripes, row_bytes), dtype=xp.uint8)
            for c, s in terms:
                gf256.mul_xor_into(acc[: shards[s].shape[0]], c, shards[s], xp)
            shards[target] = acc
        return {s: _as_rows(shards[s][: out_rows[s]], dtype) for s in lost}

    # -- helpers --------------------------------------------------------------------------------

    def _shard(self, s: Any) -> int:
        s = _check_index(s, "a shard index")
        if not 0 <= s < self.n_shards:
            raise UserInputError(
                f"shard index {s} is outside 0..{self.n_shards - 1} (k={self.k}, r={self.r})"
            )
        return s


def _to_host(a: Any) -> Any:
    return a.get() if hasattr(a, "get") else a  # cupy -> numpy; numpy unchanged


# -- stripes, chunks and degraded reads ---------------------------------------------------------


def stripe_chunks(n_stripes: int, chunk: int) -> list[tuple[int, int]]:
    """``[start, stop)`` ranges of at most ``chunk`` stripes covering ``0..n_stripes``."""
    if chunk < 1:
        raise UserInputError(f"a rebuild chunk must hold at least one stripe, got {chunk}")
    return [(start, min(start + chunk, n_stripes)) for start in range(0, n_stripes, chunk)]


def gather_stripes(shard: Any, stripes: Any, xp: Any = np) -> Any:
    """A survivor's rows at ``stripes`` for a degraded read: zero rows for stripes past its end."""
    idx = xp.asarray(stripes).astype(xp.int64, copy=False)
    if idx.ndim != 1 or (idx.size and int(idx.min()) < 0):
        raise UserInputError("stripes to gather must be a 1-D array of non-negative indices")
    source = _bytes(shard, "shard", xp)
    if not idx.size or int(idx.max()) < source.shape[0]:
        # Every stripe inside (all but a short data shard's last): one copy. take() moves whole rows,
        # several times faster than a fancy index into zeros.
        return _as_rows(xp.take(source, idx, axis=0), shard.dtype)
    out = xp.zeros((idx.size, source.shape[1]), dtype=xp.uint8)
    inside = idx < source.shape[0]
    out[inside] = source[idx[inside]]
    return _as_rows(out, shard.dtype)
