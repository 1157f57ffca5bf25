"""Erasure-code throughput (encode, delta update, decode) next to a plain copy of the same bytes.

The baseline is ``xp.copyto`` of the same number of bytes: what writing a full replica (or a
checkpoint into memory) of those bytes costs in memory bandwidth. A ratio "x copy" of 3.0 means
the operation takes 3 times as long as copying its bytes once.

    python benchmarks/erasure.py                       # NumPy, plus CuPy when a GPU is present
    python benchmarks/erasure.py --xp numpy --k 4 8 --rows 65536

Shards hold float32 rows of ``--width`` floats (default 17: a 16-float embedding + 1 Adagrad
accumulator). Operations and the bytes their GB/s counts:

- encode:  all r parity shards from k data shards; bytes = the k data shards.
- delta:   one write-back batch: ``--delta-fraction`` of every data shard's rows change; their
           changes (xor_bits) are combined into one message per parity shard (combine_changes) and
           applied to every parity shard (apply_delta), as the parity write path does; bytes = the
           changed data rows.
- replica rows: the reference for delta: writing the same changed rows into a full replica of
           the shards (a row scatter); bytes = the changed data rows.
- decode n: rebuild n lost data shards from k survivors: n = 1 (XOR from parity 0) and n = r (the
           worst case); bytes = the rebuilt shards.

Timings are medians over ``--repeats`` runs after one warm-up. On a shared CPU box they are noisy.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from dlrmflow.engine.coding.erasure import ErasureCode, xor_bits


def _sync(xp: Any) -> None:
    if xp is not np:
        xp.cuda.Device().synchronize()


def median_seconds(fn: Callable[[], Any], xp: Any, repeats: int) -> float:
    fn()  # warm-up: kernel compilation, table caches, page faults
    times = []
    for _ in range(repeats):
        _sync(xp)
        start = time.perf_counter()
        fn()
        _sync(xp)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def random_shard(xp: Any, rng: np.random.Generator, rows: int, width: int) -> Any:
    return xp.asarray(rng.integers(0, 2**32, size=(rows, width), dtype=np.uint32).view(np.float32))


def copy_seconds(xp: Any, n_bytes: int, repeats: int) -> float:
    src = xp.ones(n_bytes, dtype=xp.uint8)
    dst = xp.empty_like(src)
    return median_seconds(lambda: xp.copyto(dst, src), xp, repeats)


def bench(xp: Any, k: int, r: int, rows: int, width: int, fraction: float, repeats: int) -> list[dict]:
    rng = np.random.default_rng(k * 10 + r)
    code = ErasureCode(k, r)
    data = [random_shard(xp, rng, rows, width) for _ in range(k)]
    shard_bytes = data[0].nbytes
    parity = code.encode(data, xp)

    n_changed = max(1, int(rows * fraction))
    changed = [xp.asarray(np.sort(rng.choice(rows, size=n_changed, replace=False))) for _ in range(k)]
    old_rows = [data[s][changed[s]] for s in range(k)]
    new_rows = [random_shard(xp, rng, n_changed, width) for _ in range(k)]
    shard_of_change = xp.concatenate([xp.full(n_changed, shard, dtype=xp.int64) for shard in range(k)])
    rows_of_change = xp.concatenate(changed)

    def delta_round() -> None:
        changes = xp.concatenate([xor_bits(old_rows[s], new_rows[s], xp) for s in range(k)])
        message = code.combine_changes(shard_of_change, rows_of_change, changes, xp)
        for p in range(r):
            code.apply_delta(parity[p], message.parity[p], xp, rows=message.stripes)

    def replica_rows() -> None:  # what a replica of the changed rows would write instead
        for s in range(k):
            replica[s][changed[s]] = new_rows[s]

    replica = [xp.empty_like(d) for d in data]
    shards = data + parity
    ops = [
        ("encode", lambda: code.encode(data, xp), k * shard_bytes),
        ("delta", delta_round, sum(n.nbytes for n in new_rows)),
        ("replica rows", replica_rows, sum(n.nbytes for n in new_rows)),
    ]
    for n_lost in sorted({1, r}):  # one data shard (XOR from parity 0) and r data shards
        lost = list(range(n_lost))
        available = {s: a for s, a in enumerate(shards) if s not in lost}
        ops.append((f"decode {n_lost}", lambda a=available, lost=lost: code.decode(a, lost, xp), n_lost * shard_bytes))
    results = []
    for op, fn, n_bytes in ops:
        seconds = median_seconds(fn, xp, repeats)
        baseline = copy_seconds(xp, n_bytes, repeats)
        results.append(
            {
                "xp": xp.__name__,
                "k": k,
                "r": r,
                "op": op,
                "MB": n_bytes / 1e6,
                "ms": seconds * 1e3,
                "GB/s": n_bytes / seconds / 1e9,
                "copy GB/s": n_bytes / baseline / 1e9,
                "x copy": seconds / baseline,
            }
        )
    return results


def print_table(rows: list[dict]) -> None:
    columns = ["xp", "k", "r", "op", "MB", "ms", "GB/s", "copy GB/s", "x copy"]
    cells = [[f"{row[c]:.2f}" if isinstance(row[c], float) else str(row[c]) for c in columns] for row in rows]
    widths = [max(len(c), *(len(cell[i]) for cell in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)))
    for cell in cells:
        print("  ".join(v.rjust(w) for v, w in zip(cell, widths, strict=True)))


def available_modules(choice: str) -> list[Any]:
    modules: list[Any] = [np] if choice in ("numpy", "auto") else []
    if choice in ("cupy", "auto"):
        try:
            import cupy

            if cupy.cuda.runtime.getDeviceCount() > 0:
                modules.append(cupy)
        except Exception as exc:  # no cupy or no GPU: NumPy only, unless CuPy was asked for
            if choice == "cupy":
                raise SystemExit(f"CuPy was requested but is unusable here: {exc}") from exc
    return modules


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--xp", choices=["auto", "numpy", "cupy"], default="auto")
    parser.add_argument("--k", type=int, nargs="+", default=[4, 5, 6, 7, 8], help="data shards")
    parser.add_argument("--r", type=int, nargs="+", default=[1, 2], help="parity shards")
    parser.add_argument("--rows", type=int, default=1 << 18, help="rows per data shard")
    parser.add_argument("--width", type=int, default=17, help="float32 values per row")
    parser.add_argument("--delta-fraction", type=float, default=0.1, help="rows changed per write-back")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    results = []
    for xp in available_modules(args.xp):
        for k in args.k:
            for r in args.r:
                results.extend(bench(xp, k, r, args.rows, args.width, args.delta_fraction, args.repeats))
    shard_mb = args.rows * args.width * 4 / 1e6
    print(
        f"shards: {args.rows} rows x {args.width} float32 = {shard_mb:.1f} MB each; medians of {args.repeats}"
    )
    print_table(results)


if __name__ == "__main__":
    main()
