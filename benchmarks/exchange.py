"""One exchange on its own: wall time and CPU of ``ShardGroup.exchange``, one call per shard against two
concurrent calls (the write-back and the fetch apart), by link rate; with ``--parity R``, of an erasure-coded
group's (``CodedShardGroup.exchange``: R parity shards more behind the link, a batch's parity deltas sent
every ``parity_batches`` exchanges as in training).

The embedding servers are Dask workers behind the emulated link (:func:`dlrmflow.engine.serving.cluster.shaped_cluster`,
docs/network.md), the trainer's side runs here. Each exchange writes ``--rows`` rows home and fetches as many
other rows (distinct random ids, so the two sets are disjoint, as most of an oracle's are); the two ways
alternate in blocks of ``--per-block`` exchanges for ``--blocks`` blocks (the machine's load drifts). Per
(rate, way): the median wall time of one exchange, and the CPU milliseconds per exchange of this process
(client and scheduler) and of the servers together (their idle housekeeping included: it grows with the
wall time). A warm-up block of each way runs first, unmeasured. The line "one direction at the rate" is the rows of one
direction at the link's rate: no way of sending both can take less. Every exchange's fetched rows are
checked against a copy of the table kept here (bit for bit): the answer must not depend on the way.

    .venv/bin/python benchmarks/exchange.py [--rates unshaped,50,20,10] [--rows 3000] [--dim 16] [--parity R]

Needs root or CAP_NET_ADMIN (network namespaces, tc); without them it says so in one line and exits 2.
"""

from __future__ import annotations

# isort: off
import dlrmflow  # noqa: F401  (first: it sets OMP_WAIT_POLICY before anything loads torch; see network.py)
# isort: on
import argparse
import os
import statistics
import sys
import time

import numpy as np
from distributed import Client

from dlrmflow.engine.coding.start import start_coded_shards
from dlrmflow.engine.serving.cluster import shaped_cluster
from dlrmflow.engine.serving.embedding_rows import RowSpec, init_rows
from dlrmflow.engine.serving.shaped_link import LinkUnavailableError
from dlrmflow.engine.serving.shards import ShardGroup, start_shards

# ShardGroup.overlap_min_bytes and overlap_max_rate that make every exchange go one way
WAYS = {"one call per shard": (1 << 62, 0.0), "fetch and write-back apart": (0, float("inf"))}


def servers_cpu(client: Client, servers: list[str]) -> float:
    return float(sum(client.run(time.process_time, workers=servers).values()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="unshaped,50,20,10", help="Mbit/s, 'unshaped' for the link without tbf")
    parser.add_argument("--rows", type=int, default=3000, help="rows written and rows fetched per exchange")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--per-block", type=int, default=5)
    parser.add_argument("--parity", type=int, default=0, help="R parity shards: an erasure-coded group (0: plain)")
    args = parser.parse_args()
    spec = RowSpec(dim=args.dim, optimizer="sgd", seed=0, table_offsets=(0,), cardinalities=(1_000_000,))
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; {args.rows} rows of {spec.row_bytes} "
          f"bytes each way ({args.rows * spec.row_bytes / 1e6:.3f} MB), {args.shards} shards"
          + (f" and {args.parity} parity shards" if args.parity else ""), flush=True)
    original = ShardGroup.overlap_min_bytes, ShardGroup.overlap_max_rate
    try:
        with shaped_cluster(None, n_servers=args.shards + args.parity) as cluster, \
                Client(cluster.address, direct_to_workers=True) as client:
            group = (start_coded_shards(client, spec, args.shards, args.parity) if args.parity
                     else start_shards(client, spec, args.shards))
            home = init_rows(spec, np.arange(spec.total_rows))
            rng = np.random.default_rng(0)

            def one_exchange() -> tuple[float, bool]:
                """A random exchange (a row's write and a fetch never share an id): (seconds, rows right)."""
                ids = rng.choice(spec.total_rows, 2 * args.rows, replace=False)
                write, fetch = ids[: args.rows], ids[args.rows:]
                rows = rng.standard_normal((args.rows, spec.width)).astype(np.float32)
                # Held as if fetched before (a coded group writes back only rows it has the old values of).
                group.held_by_trainer(write, home[write])
                start = time.perf_counter()
                got = group.exchange(write, rows, fetch)
                seconds = time.perf_counter() - start
                home[write] = rows
                return seconds, np.array_equal(got.view(np.uint32), home[fetch].view(np.uint32))

            for min_bytes, max_rate in WAYS.values():  # warm-up, not measured: connections, first calls
                ShardGroup.overlap_min_bytes, ShardGroup.overlap_max_rate = min_bytes, max_rate
                for _ in range(args.per_block):
                    one_exchange()
            for part in args.rates.split(","):
                mbit = None if part in ("unshaped", "0") else float(part)
                cluster.link.set_rate(None if mbit is None else int(mbit * 1e6))
                wall: dict[str, list[float]] = {w: [] for w in WAYS}
                cpu = {w: [0.0, 0.0] for w in WAYS}
                for _ in range(args.blocks):
                    for way, (min_bytes, max_rate) in WAYS.items():
                        ShardGroup.overlap_min_bytes, ShardGroup.overlap_max_rate = min_bytes, max_rate
                        here, there = time.process_time(), servers_cpu(client, cluster.servers)
                        for _ in range(args.per_block):
                            seconds, right = one_exchange()
                            wall[way].append(seconds)
                            if not right:
                                print(f"{way}: fetched rows differ from the table's", file=sys.stderr)
                                return 1
                        cpu[way][0] += time.process_time() - here
                        cpu[way][1] += servers_cpu(client, cluster.servers) - there
                n = args.blocks * args.per_block
                label = "unshaped" if mbit is None else f"{mbit:g} Mbit/s"
                ideal = "" if mbit is None else \
                    f"; one direction at the rate {1e3 * args.rows * spec.row_bytes * 8 / (mbit * 1e6):.1f} ms"
                print(f"{label}{ideal}", flush=True)
                for way in WAYS:
                    print(f"    {way:<28} median {1e3 * statistics.median(wall[way]):7.1f} ms, CPU per exchange: "
                          f"here {1e3 * cpu[way][0] / n:5.2f} ms, servers {1e3 * cpu[way][1] / n:5.2f} ms",
                          flush=True)
    except LinkUnavailableError as exc:
        print(f"exchange.py: {exc}", file=sys.stderr)
        return 2
    finally:
        ShardGroup.overlap_min_bytes, ShardGroup.overlap_max_rate = original
    return 0


if __name__ == "__main__":
    sys.exit(main())
