"""The erasure code: GF(2^8) arithmetic, the MDS property, bit-exact round trips, delta updates.

Every test calls the functions production calls: the parity write path (``xor_bits``,
``combine_changes``, ``apply_delta``), degraded reads (``survivors_for``, ``gather_stripes``,
``decode``) and rebuilds (``stripe_chunks``, ``decode`` with ``n_rows``).

References used as oracles are deliberately naive and independent of the code under test:
carry-less shift-and-add multiplication for the field, a scalar triple loop for matrix products,
and byte-wise ``MUL[c][x]`` / XOR formulas for parity.
"""

from __future__ import annotations

import itertools
import pickle
from typing import Any, NamedTuple

import numpy as np
import pytest

from dlrmflow.engine.coding import gf256
from dlrmflow.engine.coding.erasure import (
    ErasureCode,
    StripeDelta,
    TooManyErasuresError,
    coding_matrix,
    gather_stripes,
    generator_matrix,
    stripe_chunks,
    xor_bits,
)
from dlrmflow.engine.errors import UserInputError

# float32 bit patterns that value-based arithmetic would not carry through unchanged.
SPECIAL_BITS = np.array(
    [
        0x7FC00000,  # the canonical quiet NaN
        0x7FC00001,  # quiet NaN with a payload
        0x7FFFFFFF,  # quiet NaN, all payload bits set
        0xFFC00000,  # negative quiet NaN
        0x7F800001,  # signalling NaN (a float op would quiet it)
        0xFFBFFFFF,  # negative signalling NaN, large payload
        0x7F800000,  # +Inf
        0xFF800000,  # -Inf
        0x00000001,  # smallest positive denormal
        0x807FFFFF,  # largest negative denormal
        0x00400000,  # a mid denormal
        0x80000000,  # -0.0
        0x00000000,  # +0.0
        0x7F7FFFFF,  # largest finite float
    ],
    dtype=np.uint32,
)


def random_rows(rng: np.random.Generator, n_rows: int, width: int) -> np.ndarray:
    """float32 [n_rows, width] of random bits with special patterns sprinkled in (~30% of cells)."""
    bits = rng.integers(0, 2**32, size=(n_rows, width), dtype=np.uint32)
    special = rng.random((n_rows, width)) < 0.3
    bits[special] = rng.choice(SPECIAL_BITS, size=int(special.sum()))
    return bits.view(np.float32)


def assert_bits_equal(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    assert np.array_equal(
        np.ascontiguousarray(actual).view(np.uint8), np.ascontiguousarray(expected).view(np.uint8)
    )


def random_shards(rng: np.random.Generator, k: int, width: int, max_rows: int = 12) -> list[np.ndarray]:
    """k data shards of uneven row counts; shard 0 has the most rows, and one may have none."""
    counts = rng.integers(0, max_rows + 1, size=k)
    counts[0] = max_rows
    return [random_rows(rng, int(n), width) for n in counts]


def reference_parity(code: ErasureCode, data: list[np.ndarray]) -> list[np.ndarray]:
    """parity_p[j] = XOR_i C[p, i] * data_i[j], byte by byte with the MUL table, zero-padded."""
    n = max(d.shape[0] for d in data)
    out = []
    for p in range(code.r):
        acc = np.zeros((n, data[0].shape[1] * data[0].itemsize), dtype=np.uint8)
        for i, d in enumerate(data):
            acc[: d.shape[0]] ^= gf256.MUL[int(code.matrix[p, i])][d.view(np.uint8)]
        out.append(acc.view(data[0].dtype))
    return out


# --------------------------------------------------------------------------------------------
# GF(2^8)


def carryless_mul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Shift-and-add multiplication modulo 0x11D: the textbook definition, no tables."""
    a, b = a.astype(np.int64), b.astype(np.int64)
    product = np.zeros(np.broadcast(a, b).shape, dtype=np.int64)
    for _ in range(8):
        product ^= np.where(b & 1, a, 0)
        b = b >> 1
        a = a << 1
        a = np.where(a & 0x100, a ^ 0x11D, a)
    return product


def test_mul_table_matches_carryless_multiplication_on_all_pairs():
    a = np.arange(256)[:, None]
    b = np.arange(256)[None, :]
    assert np.array_equal(gf256.MUL, carryless_mul(a, b))
    assert gf256.mul(0x53, 0xCA) == int(carryless_mul(np.array(0x53), np.array(0xCA)))


def test_field_axioms_exhaustively():
    mul = gf256.MUL.astype(np.int64)
    x = np.arange(256)
    assert np.array_equal(mul, mul.T)  # commutative
    assert np.array_equal(mul[1], x) and not mul[0].any()  # 1 is the identity, 0 absorbs
    b, c = np.meshgrid(x, x, indexing="ij")
    for a in range(256):  # every triple (a, b, c)
        assert np.array_equal(mul[mul[a][b], c], mul[a][mul[b, c]])  # associative
        assert np.array_equal(mul[a][b ^ c], mul[a][b] ^ mul[a][c])  # distributive over XOR
    nonzero = x[1:]
    assert np.all(mul[nonzero, gf256.INV[nonzero]] == 1)  # every non-zero element has an inverse
    assert sorted(gf256.INV[1:].tolist()) == list(range(1, 256))
    with pytest.raises(ZeroDivisionError):
        gf256.inv(0)


def test_two_generates_the_multiplicative_group():
    assert sorted(gf256.EXP[:255].tolist()) == list(range(1, 256))
    assert np.array_equal(gf256.EXP[gf256.LOG[1:]], np.arange(1, 256))


def scalar_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    out = np.zeros((a.shape[0], b.shape[1]), dtype=np.uint8)
    for i, j in itertools.product(range(a.shape[0]), range(b.shape[1])):
        for t in range(a.shape[1]):
            out[i, j] ^= gf256.mul(int(a[i, t]), int(b[t, j]))
    return out


def test_matmul_matches_scalar_reference():
    rng = np.random.default_rng(1)
    for _ in range(20):
        n, m, p = rng.integers(1, 7, size=3)
        a = rng.integers(0, 256, size=(n, m), dtype=np.uint8)
        b = rng.integers(0, 256, size=(m, p), dtype=np.uint8)
        assert np.array_equal(gf256.matmul(a, b), scalar_matmul(a, b))


def test_invert_random_invertible_matrices():
    rng = np.random.default_rng(2)
    for _ in range(30):
        n = int(rng.integers(1, 9))
        # L . U with unit diagonals, rows permuted: invertible by construction.
        lower = np.tril(rng.integers(0, 256, size=(n, n)), -1).astype(np.uint8) + np.eye(n, dtype=np.uint8)
        upper = np.triu(rng.integers(0, 256, size=(n, n)), 1).astype(np.uint8) + np.eye(n, dtype=np.uint8)
        a = scalar_matmul(lower, upper)[rng.permutation(n)]
        inverse = gf256.invert(a)
        assert np.array_equal(scalar_matmul(a, inverse), np.eye(n, dtype=np.uint8))
        assert np.array_equal(scalar_matmul(inverse, a), np.eye(n, dtype=np.uint8))


def test_invert_rejects_singular_matrices():
    rng = np.random.default_rng(3)
    for _ in range(10):
        a = rng.integers(0, 256, size=(5, 5), dtype=np.uint8)
        a[3] = gf256.MUL[7][a[1]] ^ a[0]  # a linear combination of other rows
        with pytest.raises(gf256.SingularMatrixError):
            gf256.invert(a)


@pytest.mark.parametrize("size", [0, 1, 2, 3, 7, 4096, (1 << 17) + 5])
def test_region_ops_match_the_table(size):
    rng = np.random.default_rng(size)
    x = rng.integers(0, 256, size=size, dtype=np.uint8)
    acc0 = rng.integers(0, 256, size=size, dtype=np.uint8)
    for c in [0, 1, 2, 0x1D, 0x8E, 255]:
        out = rng.integers(0, 256, size=size, dtype=np.uint8)
        gf256.mul_into(out, c, x)
        assert np.array_equal(out, gf256.MUL[c][x])
        acc = acc0.copy()
        gf256.mul_xor_into(acc, c, x)
        assert np.array_equal(acc, acc0 ^ gf256.MUL[c][x])
    acc = acc0.copy()
    gf256.xor_into(acc, x)
    assert np.array_equal(acc, acc0 ^ x)


def test_region_ops_on_odd_offsets_and_in_place():
    rng = np.random.default_rng(4)
    buffer = rng.integers(0, 256, size=1001, dtype=np.uint8)
    x = buffer[1:]  # starts at an odd address
    acc = rng.integers(0, 256, size=1000, dtype=np.uint8)
    expected = acc ^ gf256.MUL[0x35][x]
    gf256.mul_xor_into(acc, 0x35, x)
    assert np.array_equal(acc, expected)
    expected = gf256.MUL[0xC4][x]
    gf256.mul_into(x, 0xC4, x)  # in place
    assert np.array_equal(x, expected)


def test_region_ops_reject_bad_arrays():
    a = np.zeros(8, dtype=np.uint8)
    with pytest.raises(ValueError, match="equal shapes"):
        gf256.mul_xor_into(a, 3, np.zeros(7, dtype=np.uint8))
    with pytest.raises(TypeError, match="uint8"):
        gf256.mul_into(a, 3, np.zeros(8, dtype=np.int16))
    with pytest.raises(ValueError, match="contiguous"):
        gf256.mul_xor_into(np.zeros(16, dtype=np.uint8)[::2], 3, a)


# --------------------------------------------------------------------------------------------
# The coding matrix


def singular_patterns(generator: np.ndarray, k: int) -> list[tuple[int, ...]]:
    """Every choice of k surviving shards whose rows of the generator cannot be inverted."""
    bad = []
    for survivors in itertools.combinations(range(generator.shape[0]), k):
        try:
            gf256.invert(generator[list(survivors)])
        except gf256.SingularMatrixError:
            bad.append(survivors)
    return bad


@pytest.mark.parametrize("r", [1, 2, 3, 4])
def test_every_decoding_matrix_is_invertible(r):
    """The MDS property, exhaustively: every k of the k + r shards determine the data (k <= 12)."""
    for k in range(1, 13):
        assert singular_patterns(generator_matrix(k, r), k) == [], (k, r)


def test_the_invertibility_check_catches_a_bad_matrix():
    # A coding matrix with two equal columns: losing those two data shards is undecodable.
    k, r = 4, 2
    bad = coding_matrix(k, r).copy()
    bad[:, 2] = bad[:, 1]
    generator = np.concatenate([np.eye(k, dtype=np.uint8), bad])
    assert (0, 3, 4, 5) in singular_patterns(generator, k)


@pytest.mark.parametrize("r", [1, 2, 3, 4])
def test_every_square_submatrix_of_the_coding_matrix_is_invertible(r):
    """The Cauchy property the MDS argument rests on (k up to 12)."""
    matrix = coding_matrix(12, r)
    for size in range(1, r + 1):
        for rows in itertools.combinations(range(r), size):
            for cols in itertools.combinations(range(12), size):
                gf256.invert(matrix[np.ix_(rows, cols)])


def test_parity_zero_is_xor():
    for k, r in itertools.product(range(1, 20), range(1, 5)):
        assert np.all(coding_matrix(k, r)[0] == 1)
        assert np.all(coding_matrix(k, r) != 0)


# --------------------------------------------------------------------------------------------
# Encode and decode


def test_encode_matches_reference_and_xor_for_r1():
    rng = np.random.default_rng(5)
    for k, r in [(1, 1), (3, 1), (5, 2), (7, 3), (4, 4)]:
        code = ErasureCode(k, r)
        data = random_shards(rng, k, width=17)
        parity = code.encode(data)
        for have, want in zip(parity, reference_parity(code, data), strict=True):
            assert_bits_equal(have, want)
        xor = np.zeros_like(parity[0].view(np.uint8))
        for d in data:
            xor[: d.shape[0]] ^= d.view(np.uint8)
        assert_bits_equal(parity[0], xor.view(np.float32))


def k_values_for(r: int) -> list[int]:
    rng = np.random.default_rng(100 + r)
    return sorted({1, 2, 12, *rng.integers(3, 12, size=3).tolist()})


@pytest.mark.parametrize("r", [1, 2, 3, 4])
def test_every_erasure_pattern_round_trips_bit_exactly(r):
    rng = np.random.default_rng(r)
    for k in k_values_for(r):
        code = ErasureCode(k, r)
        data = random_shards(rng, k, width=int(rng.integers(1, 6)), max_rows=int(rng.integers(1, 9)))
        shards = data + code.encode(data)
        rows = {i: d.shape[0] for i, d in enumerate(data)}
        for n_lost in range(r + 1):
            for lost in itertools.combinations(range(k + r), n_lost):
                available = {s: a for s, a in enumerate(shards) if s not in lost}
                rebuilt = code.decode(available, list(lost), n_rows={s: rows[s] for s in lost if s < k})
                assert sorted(rebuilt) == list(lost)
                for s in lost:
                    assert_bits_equal(rebuilt[s], shards[s])


def test_decode_without_row_counts_pads_with_zero_rows():
    rng = np.random.default_rng(6)
    code = ErasureCode(3, 2)
    data = [random_rows(rng, 9, 4), random_rows(rng, 5, 4), random_rows(rng, 0, 4)]
    parity = code.encode(data)
    rebuilt = code.decode({0: data[0], 3: parity[0], 4: parity[1]}, [1, 2])
    for s in (1, 2):
        assert rebuilt[s].shape == (9, 4)
        assert_bits_equal(rebuilt[s][: data[s].shape[0]], data[s])
        assert not rebuilt[s].view(np.uint32)[data[s].shape[0] :].any()


def test_other_dtypes_round_trip():
    rng = np.random.default_rng(7)
    code = ErasureCode(3, 2)
    data = [
        rng.standard_normal((6, 5)),
        rng.integers(-9, 9, size=(6, 5)).astype(np.float64),
        np.full((6, 5), -0.0),
    ]
    data[0][2, 3] = np.nan
    parity = code.encode(data)
    rebuilt = code.decode({1: data[1], 3: parity[0], 4: parity[1]}, [0, 2])
    assert_bits_equal(rebuilt[0], data[0])
    assert_bits_equal(rebuilt[2], data[2])


def test_verify_points_at_the_corrupted_stripe():
    rng = np.random.default_rng(8)
    code = ErasureCode(4, 2)
    data = random_shards(rng, 4, width=17)
    parity = code.encode(data)
    assert all(m.size == 0 for m in code.verify(data, parity))
    parity[1].view(np.uint8)[5, 13] ^= 0x10  # one flipped bit
    mismatches = code.verify(data, parity)
    assert mismatches[0].size == 0
    assert mismatches[1].tolist() == [5]


# --------------------------------------------------------------------------------------------
# Delta updates


class RowUpdate(NamedTuple):
    """Rows ``rows`` (unique local indices = stripes) of data shard ``shard`` went ``old -> new``."""

    shard: int
    rows: np.ndarray
    old: np.ndarray
    new: np.ndarray


def random_update(rng, data: list[np.ndarray], shard: int) -> RowUpdate | None:
    n = data[shard].shape[0]
    if n == 0:
        return None
    rows = rng.choice(n, size=int(rng.integers(1, n + 1)), replace=False)
    new = random_rows(rng, rows.size, data[shard].shape[1])
    if rng.random() < 0.2:
        new[0] = data[shard][rows[0]]  # an unchanged row: zero delta
    return RowUpdate(shard, rows, data[shard][rows].copy(), new)


def message_of(code: ErasureCode, updates: list[RowUpdate]) -> StripeDelta:
    """What the parity write path sends for ``updates``: their row changes, combined per stripe."""
    shards = np.concatenate([np.full(u.rows.size, u.shard) for u in updates])
    rows = np.concatenate([u.rows for u in updates])
    return code.combine_changes(shards, rows, np.concatenate([xor_bits(u.old, u.new) for u in updates]))


def reference_delta(code: ErasureCode, p: int, update: RowUpdate) -> np.ndarray:
    """``C[p, shard] * (old ^ new)``, byte by byte with the MUL table: parity p's change."""
    return gf256.MUL[int(code.matrix[p, update.shard])][update.old.view(np.uint8) ^ update.new.view(np.uint8)]


@pytest.mark.parametrize("r", [1, 2, 3, 4])
def test_delta_updates_equal_a_fresh_encode(r):
    """Per update and per batch of updates (a shard may appear twice in one batch)."""
    rng = np.random.default_rng(10 + r)
    for k in (1, 3, 8):
        code = ErasureCode(k, r)
        data = random_shards(rng, k, width=17, max_rows=20)
        one_by_one = code.encode(data)
        combined = [p.copy() for p in one_by_one]
        for _ in range(15):  # write-back batches
            batch = []
            for _ in range(int(rng.integers(1, 4))):
                update = random_update(rng, data, int(rng.integers(0, k)))
                if update is None:
                    continue
                batch.append(update)
                single = message_of(code, [update])
                assert np.array_equal(single.stripes, np.sort(update.rows))
                for p in range(r):
                    code.apply_delta(one_by_one[p], single.parity[p], rows=single.stripes)
                data[update.shard][update.rows] = update.new
            if batch:
                message = message_of(code, batch)
                assert np.array_equal(message.stripes, np.unique(np.concatenate([u.rows for u in batch])))
                for p in range(r):
                    code.apply_delta(combined[p], message.parity[p], rows=message.stripes)
        for fresh, a, b in zip(code.encode(data), one_by_one, combined, strict=True):
            assert_bits_equal(a, fresh)
            assert_bits_equal(b, fresh)


def test_combined_deltas_equal_the_sum_of_single_deltas():
    rng = np.random.default_rng(20)
    code = ErasureCode(5, 3)
    data = [random_rows(rng, 30, 17) for _ in range(5)]
    updates = [random_update(rng, data, shard) for shard in (0, 2, 3, 4)]
    message = message_of(code, updates)
    expected = np.zeros((code.r, 30, 17 * 4), dtype=np.uint8)
    for u in updates:
        for p in range(code.r):
            expected[p][u.rows] ^= reference_delta(code, p, u)
    touched = message.stripes
    for p in range(code.r):
        assert_bits_equal(message.parity[p], expected[p][touched].view(np.float32))
        untouched = np.setdiff1d(np.arange(30), touched)
        assert not expected[p][untouched].any()


@pytest.mark.parametrize("r", [1, 2, 3, 4])
def test_the_changes_of_many_batches_compose_into_one_message(r):
    """A message carries the changes of several write-back batches, in the order they happened: a
    row may change in several of them, and a stripe may change on several shards. One combined
    delta applied to the parity equals a fresh encode of the final data."""
    rng = np.random.default_rng(30 + r)
    for k in (1, 2, 5, 9):
        code = ErasureCode(k, r)
        data = random_shards(rng, k, width=17, max_rows=20)
        parity = code.encode(data)
        for _ in range(6):  # messages
            shards, rows, changes = [], [], []
            for _ in range(int(rng.integers(1, 9))):  # batches: rows repeat across them
                for update in (random_update(rng, data, int(rng.integers(0, k))) for _ in range(2)):
                    if update is None:
                        continue
                    shards.append(np.full(update.rows.size, update.shard))
                    rows.append(update.rows)
                    changes.append(xor_bits(update.old, update.new))
                    data[update.shard][update.rows] = update.new
            if not rows:
                continue
            message = code.combine_changes(np.concatenate(shards), np.concatenate(rows), np.concatenate(changes))
            assert np.array_equal(message.stripes, np.unique(np.concatenate(rows)))
            for p in range(r):
                code.apply_delta(parity[p], message.parity[p], rows=message.stripes)
        for fresh, got in zip(code.encode(data), parity, strict=True):
            assert_bits_equal(got, fresh)


def test_a_row_changed_back_and_forth_leaves_a_zero_delta():
    code = ErasureCode(3, 2)
    rng = np.random.default_rng(31)
    a, b = random_rows(rng, 1, 17), random_rows(rng, 1, 17)
    changes = np.concatenate([xor_bits(a, b), xor_bits(b, a), xor_bits(a, b)])
    message = code.combine_changes([2, 2, 0], [4, 4, 1], changes)
    assert message.stripes.tolist() == [1, 4]
    for p in range(2):
        assert not message.parity[p][1].view(np.uint32).any()  # a -> b -> a: no change
        assert message.parity[p][0].view(np.uint32).any()
    empty = code.combine_changes(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, 17), np.float32))
    assert empty.stripes.size == 0 and [d.shape for d in empty.parity] == [(0, 17), (0, 17)]


def test_the_delta_of_one_shard_is_coefficient_times_xor():
    rng = np.random.default_rng(21)
    code = ErasureCode(6, 4)
    old, new = random_rows(rng, 7, 17), random_rows(rng, 7, 17)
    for shard in range(6):
        update = RowUpdate(shard, rng.permutation(7), old, new)
        message = message_of(code, [update])
        assert message.stripes.tolist() == list(range(7))
        for p in range(code.r):
            want = reference_delta(code, p, update)[np.argsort(update.rows)]
            assert_bits_equal(message.parity[p], want.view(np.float32))


def test_xor_bits_is_the_bytewise_xor_in_the_rows_dtype():
    rng = np.random.default_rng(23)
    for dtype, width in ((np.float32, 17), (np.float64, 3), (np.uint8, 5), (np.float16, 7)):
        old = rng.integers(0, 256, size=(6, width * np.dtype(dtype).itemsize), dtype=np.uint8).view(dtype)
        new = rng.integers(0, 256, size=old.view(np.uint8).shape, dtype=np.uint8).view(dtype)
        old[0] = new[0]  # an unchanged row
        change = xor_bits(old, new)
        assert change.dtype == old.dtype and change.shape == old.shape
        assert np.array_equal(change.view(np.uint8), old.view(np.uint8) ^ new.view(np.uint8))
        assert not change[0].view(np.uint8).any()


def test_apply_delta_on_all_rows_and_on_a_slice():
    rng = np.random.default_rng(22)
    code = ErasureCode(2, 1)
    parity, delta = random_rows(rng, 10, 3), random_rows(rng, 10, 3)
    expected = (parity.view(np.uint8) ^ delta.view(np.uint8)).view(np.float32)
    whole = parity.copy()
    code.apply_delta(whole, delta)
    assert_bits_equal(whole, expected)
    sliced = parity.copy()
    code.apply_delta(sliced, delta[2:6], rows=slice(2, 6))
    assert_bits_equal(sliced[2:6], expected[2:6])
    assert_bits_equal(sliced[6:], parity[6:])


# --------------------------------------------------------------------------------------------
# Chunked rebuild and degraded reads, as the coded shard group does them


def survivors_of(code: ErasureCode, lost: list[int]) -> tuple[int, ...]:
    return code.survivors_for([s for s in range(code.n_shards) if s not in lost])


def rebuild_in_chunks(code: ErasureCode, shards: list[np.ndarray], lost: list[int], chunk: int,
                      read: Any) -> dict[int, np.ndarray]:
    """A rebuild's bulk copy of whole shards: per chunk of stripes, read k survivors' rows
    (``read(shard, start, stop)``, fewer rows where a shard ends), decode the lost shards, cut each
    lost data shard at its own row count (``n_rows``), and put the chunks together."""
    n_stripes = max(a.shape[0] for a in shards)
    total = {s: shards[s].shape[0] for s in lost}
    survivors = survivors_of(code, lost)
    pieces: dict[int, list[np.ndarray]] = {s: [] for s in lost}
    for start, stop in stripe_chunks(n_stripes, chunk) or [(0, 0)]:
        n_rows = {s: max(0, min(total[s], stop) - start) for s in lost}
        decoded = code.decode({s: read(s, start, stop) for s in survivors}, lost, n_rows=n_rows)
        for s in lost:
            pieces[s].append(decoded[s])
    return {s: np.concatenate(pieces[s]) for s in lost}


def test_rebuild_in_chunks_equals_the_lost_shards():
    rng = np.random.default_rng(30)
    for k, r, chunk in [(1, 1, 1), (4, 1, 3), (5, 2, 4), (6, 3, 100), (3, 4, 2)]:
        code = ErasureCode(k, r)
        data = random_shards(rng, k, width=17, max_rows=23)
        shards = data + code.encode(data)
        lost = sorted(rng.choice(k + r, size=int(rng.integers(1, r + 1)), replace=False).tolist())
        reads = []

        def read(s, start, stop, shards=shards, reads=reads, lost=lost):
            assert s not in lost
            reads.append(s)
            return shards[s][start:stop]

        rebuilt = rebuild_in_chunks(code, shards, lost, chunk, read)
        for s in lost:
            assert_bits_equal(rebuilt[s], shards[s])
        n_chunks = len(stripe_chunks(max(d.shape[0] for d in data), chunk))
        assert len(reads) == k * n_chunks  # only k survivors are read, once per chunk


@pytest.mark.parametrize("r", [1, 2, 3, 4])
def test_every_erasure_pattern_rebuilds_from_chunks_of_scattered_stripes(r):
    """The fix-up path: chunks are sorted arrays of stripes (those written during the bulk copy),
    gathered from the survivors; a lost data shard holds the chunk's stripes below its row count."""
    rng = np.random.default_rng(50 + r)
    for k in (1, 3, 6):
        code = ErasureCode(k, r)
        data = random_shards(rng, k, width=5, max_rows=30)
        shards = data + code.encode(data)
        n_stripes = shards[k].shape[0]
        stripes = np.flatnonzero(rng.random(n_stripes) < 0.5)
        for n_lost in range(1, r + 1):
            for lost in itertools.combinations(range(k + r), n_lost):
                for start, stop in stripe_chunks(stripes.size, 4):
                    chunk = stripes[start:stop]
                    pieces = {s: gather_stripes(shards[s], chunk) for s in survivors_of(code, list(lost))}
                    n_rows = {s: int(np.searchsorted(chunk, shards[s].shape[0])) for s in lost}
                    decoded = code.decode(pieces, list(lost), n_rows=n_rows)
                    for s in lost:
                        assert_bits_equal(decoded[s], shards[s][chunk[: n_rows[s]]])


def test_rebuild_of_empty_shards():
    code = ErasureCode(2, 1)
    data = [np.zeros((0, 3), np.float32), np.zeros((0, 3), np.float32)]
    shards = data + code.encode(data)
    rebuilt = rebuild_in_chunks(code, shards, [0], 4, lambda s, a, b: shards[s][a:b])
    assert rebuilt[0].shape == (0, 3) and rebuilt[0].dtype == np.float32


def test_degraded_read_of_random_stripes():
    """Rows of a lost shard at any stripes: the k survivors' rows there (zero past a short shard's
    end), decoded."""
    rng = np.random.default_rng(31)
    code = ErasureCode(5, 2)
    data = random_shards(rng, 5, width=17, max_rows=40)
    shards = data + code.encode(data)
    for lost in ([1], [0, 3], [2, 6], [6, 4]):
        survivors = survivors_of(code, lost)
        assert len(survivors) == code.k and not set(survivors) & set(lost)
        for target in lost:
            # Random stripes of the target, past the ends of shorter survivors too.
            stripes = rng.choice(shards[target].shape[0], size=min(15, shards[target].shape[0]), replace=False)
            ordered = np.unique(stripes)
            decoded = code.decode({s: gather_stripes(shards[s], ordered) for s in survivors}, sorted(lost))
            rows = decoded[target][np.searchsorted(ordered, stripes)]
            assert_bits_equal(rows, shards[target][stripes])


def test_gather_stripes_pads_past_the_end():
    rows = np.arange(6, dtype=np.float32).reshape(3, 2)
    got = gather_stripes(rows, np.array([2, 5, 0]))
    assert_bits_equal(got, np.array([[4, 5], [0, 0], [0, 1]], dtype=np.float32))


@pytest.mark.parametrize("seed", range(5))
def test_gather_stripes_inside_the_shard_copies_every_bit_of_those_rows(seed):
    """Stripes all inside (the common case, taken whole-row) and with some past the end give the
    same bits: NaN payloads, infinities and denormals are bytes, never floats; repeats allowed;
    the result is a copy, not a view of the shard (the shard's rows change under later batches)."""
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, 2**32, size=(50, 3), dtype=np.uint32).view(np.float32)
    rows[0, 0] = np.float32(np.inf)
    inside = rng.integers(0, 50, size=int(rng.integers(0, 80)))
    got = gather_stripes(rows, inside)
    assert_bits_equal(got, rows[inside])
    padded = gather_stripes(rows, np.concatenate([inside, [50 + seed]]))
    assert_bits_equal(padded[:-1], got)
    assert not np.shares_memory(got, rows)


# --------------------------------------------------------------------------------------------
# Bad configurations and inputs


@pytest.mark.parametrize(
    ("k", "r", "message"),
    [
        (0, 1, "at least one data shard"),
        (-3, 2, "at least one data shard"),
        (4, 0, "between 1 and 4"),
        (4, 5, "between 1 and 4"),
        (252, 4, "256 shards"),
        (2.0, 1, "must be an integer"),
        (True, 1, "must be an integer"),
        ("3", 1, "must be an integer"),
    ],
)
def test_bad_configs_are_rejected(k, r, message):
    with pytest.raises(UserInputError, match=message):
        ErasureCode(k, r)


def test_largest_code_is_accepted():
    code = ErasureCode(251, 4)
    assert code.n_shards == 255 and np.all(code.matrix != 0)


@pytest.mark.parametrize(("k", "r"), [(1, 1), (3, 1), (4, 2), (3, 3), (5, 4)])
def test_too_many_erasures_names_what_was_lost(k, r):
    rng = np.random.default_rng(40)
    code = ErasureCode(k, r)
    data = random_shards(rng, k, width=2)
    shards = data + code.encode(data)
    for lost in itertools.combinations(range(k + r), r + 1):
        available = {s: a for s, a in enumerate(shards) if s not in lost}
        with pytest.raises(TooManyErasuresError) as caught:
            code.decode(available, list(lost))
        error = caught.value
        assert isinstance(error, UserInputError)
        assert error.lost == list(lost)
        assert error.survivors == sorted(available)
        assert f"{r + 1} of {k + r} shards are lost" in str(error)
        assert f"rebuilds at most {r}" in str(error)
        assert "none of the lost shards can be recovered" in str(error)


def test_code_and_errors_survive_pickling():
    # Dask ships the code to shard actors and errors back from workers.
    code = ErasureCode(6, 3)
    assert pickle.loads(pickle.dumps(code)) == code
    with pytest.raises(TooManyErasuresError) as caught:
        code.survivors_for([0, 1, 2, 3, 4])
    copy = pickle.loads(pickle.dumps(caught.value))
    assert str(copy) == str(caught.value) and copy.lost == [5, 6, 7, 8]


def test_error_message_spells_out_data_and_parity():
    code = ErasureCode(4, 2)
    with pytest.raises(
        TooManyErasuresError, match=r"lost \(data shards 0, 2; parity shards 1 \(shard indices 5\)\)"
    ):
        code.survivors_for([1, 3, 4])


def test_bad_inputs_are_rejected():
    rng = np.random.default_rng(41)
    code = ErasureCode(3, 2)
    data = [random_rows(rng, 4, 3) for _ in range(3)]
    parity = code.encode(data)
    available = {0: data[0], 1: data[1], 3: parity[0]}
    cases = [
        (lambda: code.encode(data[:2]), "k=3 data shards"),
        (lambda: code.encode([data[0], data[1], random_rows(rng, 4, 2)]), "share dtype and row width"),
        (lambda: code.encode([data[0], data[1], data[2].astype(np.float64)]), "share dtype and row width"),
        (lambda: code.encode([data[0], data[1], data[2].ravel()]), "2-D array"),
        (lambda: code.decode(available, [7]), "outside 0..4"),
        (lambda: code.decode(available, [2, 2]), "repeat"),
        (lambda: code.decode(available, [0, 2]), "both as available and as lost"),
        (lambda: code.decode(available, [2], n_rows={2: 5}), "outside 0..4"),
        (lambda: code.apply_delta(parity[0], parity[1][:2], rows=[0, 9]), "0..3"),
        (lambda: code.apply_delta(parity[0], parity[1][:2], rows=[1, 1]), "repeats a row"),
        (lambda: code.apply_delta(parity[0], parity[1][:2], rows=[0, 1.5]), "integer row indices"),
        (lambda: code.apply_delta(parity[0], parity[1][:3], rows=[0, 1]), "must have shape"),
        (lambda: code.apply_delta(parity[0], parity[1][:3]), "does not match"),
        (lambda: code.apply_delta(parity[0], parity[1].astype(np.float64)), "float64"),
        (lambda: code.combine_changes([0, 1], [0, 1, 2], data[0][:3]), "one of each per change"),
        (lambda: code.combine_changes([0, 3], [0, 1], data[0][:2]), "outside 0..2"),
        (lambda: code.combine_changes([0, 1], [0, -1], data[0][:2]), "negative row"),
        (lambda: code.combine_changes([0, 1], [0, 1], data[0][0]), "2-D array"),
        (lambda: code.combine_changes([0, 1], [0.5, 1], data[0][:2]), "integer row indices"),
        (lambda: code.combine_changes([0, 0], [0, 1], np.zeros((2, 0), np.float32)), "width 0"),
        (lambda: code.combine_changes([[0, 1]], [0, 1], data[0][:2]), "1-D array"),
        (lambda: xor_bits(data[0][:2], data[1][:3]), "differ in shape"),
        (lambda: xor_bits(data[0][:2], data[1][:2].astype(np.float64)), "differ in shape or dtype"),
        (lambda: code.verify(data, parity[:1]), "r=2 parity shards"),
        (lambda: stripe_chunks(10, 0), "at least one stripe"),
    ]
    for call, message in cases:
        with pytest.raises(UserInputError, match=message):
            call()
