"""The erasure code on CuPy gives the same bytes as on NumPy (skipped without cupy and a CUDA GPU)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
try:
    _devices = cupy.cuda.runtime.getDeviceCount()
except Exception:  # no driver, no runtime: no GPU to test on
    _devices = 0
if _devices < 1:
    pytest.skip("no CUDA device", allow_module_level=True)

from dlrmflow.engine.coding import gf256  # noqa: E402
from dlrmflow.engine.coding.erasure import ErasureCode, gather_stripes, stripe_chunks, xor_bits  # noqa: E402

pytestmark = pytest.mark.cuda

SPECIAL_BITS = np.array(
    [0x7FC00001, 0xFFC00000, 0x7F800001, 0x7F800000, 0xFF800000, 0x00000001, 0x807FFFFF, 0x80000000],
    dtype=np.uint32,
)


def random_rows(rng: np.random.Generator, n_rows: int, width: int) -> np.ndarray:
    bits = rng.integers(0, 2**32, size=(n_rows, width), dtype=np.uint32)
    special = rng.random((n_rows, width)) < 0.3
    bits[special] = rng.choice(SPECIAL_BITS, size=int(special.sum()))
    return bits.view(np.float32)


def assert_same_bytes(on_gpu, on_cpu: np.ndarray) -> None:
    host = cupy.asnumpy(on_gpu)
    assert host.dtype == on_cpu.dtype and host.shape == on_cpu.shape
    assert np.array_equal(host.view(np.uint8), np.ascontiguousarray(on_cpu).view(np.uint8))


@pytest.mark.parametrize("size", [0, 1, 3, 4, 7, 4096, (1 << 20) + 3])
@pytest.mark.parametrize("offset", [0, 1, 4])
def test_region_ops_match_numpy(size, offset):
    rng = np.random.default_rng(size + offset)
    x = rng.integers(0, 256, size=size + offset, dtype=np.uint8)
    acc = rng.integers(0, 256, size=size + offset, dtype=np.uint8)
    for c in [0, 1, 2, 0x8E, 255]:
        want_mul = gf256.MUL[c][x[offset:]]
        gx, gacc = cupy.asarray(x), cupy.asarray(acc)
        out = cupy.empty(size, dtype=cupy.uint8)
        gf256.mul_into(out, c, gx[offset:], cupy)
        assert_same_bytes(out, want_mul)
        gf256.mul_xor_into(gacc[offset:], c, gx[offset:], cupy)  # offset 1: the byte kernel
        assert_same_bytes(gacc[offset:], acc[offset:] ^ want_mul)


@pytest.mark.parametrize("r", [1, 2, 3, 4])
def test_encode_and_every_decode_match_numpy(r):
    rng = np.random.default_rng(r)
    k = 5
    code = ErasureCode(k, r)
    data = [random_rows(rng, n, 17) for n in (40, 33, 40, 0, 12)]
    parity = code.encode(data)
    gpu_parity = code.encode([cupy.asarray(d) for d in data], cupy)
    for g, c in zip(gpu_parity, parity, strict=True):
        assert_same_bytes(g, c)
    shards = data + parity
    gpu_shards = [cupy.asarray(s) for s in shards]
    for n_lost in range(1, r + 1):
        for lost in itertools.combinations(range(k + r), n_lost):
            n_rows = {s: data[s].shape[0] for s in lost if s < k}
            rebuilt = code.decode(
                {s: a for s, a in enumerate(gpu_shards) if s not in lost}, list(lost), cupy, n_rows=n_rows
            )
            for s in lost:
                assert_same_bytes(rebuilt[s], shards[s])


def test_deltas_match_numpy():
    rng = np.random.default_rng(7)
    code = ErasureCode(6, 3)
    data = [random_rows(rng, 50, 17) for _ in range(6)]
    shards, rows, olds, news = [], [], [], []
    for shard in (0, 2, 5, 2):
        at = rng.choice(50, size=20, replace=False)
        shards.append(np.full(20, shard))
        rows.append(at)
        olds.append(data[shard][at].copy())
        news.append(random_rows(rng, 20, 17))
    shards, rows, old, new = (np.concatenate(a) for a in (shards, rows, olds, news))
    changes = xor_bits(old, new)
    gpu_changes = xor_bits(cupy.asarray(old), cupy.asarray(new), cupy)
    assert_same_bytes(gpu_changes, changes)
    message = code.combine_changes(shards, rows, changes)
    gpu_message = code.combine_changes(cupy.asarray(shards), cupy.asarray(rows), gpu_changes, cupy)
    assert_same_bytes(gpu_message.stripes, message.stripes)
    parity = code.encode(data)
    gpu_parity = [cupy.asarray(p) for p in parity]
    for p in range(code.r):
        assert_same_bytes(gpu_message.parity[p], message.parity[p])
        code.apply_delta(parity[p], message.parity[p], rows=message.stripes)
        code.apply_delta(gpu_parity[p], gpu_message.parity[p], cupy, rows=gpu_message.stripes)
        assert_same_bytes(gpu_parity[p], parity[p])


@pytest.mark.parametrize("r", [1, 3])
def test_changes_of_several_batches_combine_on_gpu_as_on_numpy(r):
    """Rows that change in several batches (and stripes changed on several shards) XOR together."""
    rng = np.random.default_rng(9 + r)
    code = ErasureCode(5, r)
    shards = rng.integers(0, 5, size=400)
    rows = rng.integers(0, 60, size=400)  # many repeats
    changes = random_rows(rng, 400, 17)
    message = code.combine_changes(shards, rows, changes)
    gpu = code.combine_changes(cupy.asarray(shards), cupy.asarray(rows), cupy.asarray(changes), cupy)
    assert_same_bytes(gpu.stripes, message.stripes)
    for p in range(r):
        assert_same_bytes(gpu.parity[p], message.parity[p])


def test_rebuild_and_degraded_reads_on_gpu():
    """As the coded shard group does them: chunks of stripes read from k survivors and decoded with
    ``n_rows``; degraded reads gathered at scattered stripes and decoded."""
    rng = np.random.default_rng(8)
    code = ErasureCode(4, 2)
    data = [random_rows(rng, n, 17) for n in (30, 29, 30, 7)]
    shards = [cupy.asarray(s) for s in data + code.encode(data)]
    lost = [1, 5]
    survivors = code.survivors_for([s for s in range(code.n_shards) if s not in lost])
    chunks = []
    for start, stop in stripe_chunks(30, 8):
        n_rows = {1: max(0, min(29, stop) - start), 5: stop - start}
        decoded = code.decode({s: shards[s][start:stop] for s in survivors}, lost, cupy, n_rows=n_rows)
        chunks.append(decoded[1])
    assert_same_bytes(cupy.concatenate(chunks), data[1])
    stripes = cupy.asarray(np.sort(rng.choice(29, size=10, replace=False)))
    decoded = code.decode({s: gather_stripes(shards[s], stripes, cupy) for s in survivors}, lost, cupy)
    assert_same_bytes(decoded[1], data[1][cupy.asnumpy(stripes)])
    parity = code.encode(data)
    assert all(m.size == 0 for m in code.verify(shards[:4], shards[4:], cupy))
    assert_same_bytes(shards[4], parity[0])
