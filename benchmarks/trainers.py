"""W data-parallel trainers (``--trainers W``) in the server modes, behind the emulated link and unshaped.

For each W of ``--trainers`` one :func:`dlrmflow.engine.serving.cluster.shaped_cluster` runs for the whole
benchmark: its embedding servers inside the link's namespace and, for W > 1, W trainer workers beside
the scheduler (the ``trainer`` resource; each gets cores / W threads), so every fetch and write-back
between a trainer and a server crosses that cluster's link while the trainers' own collectives
(gloo) do not. W = 1 trains in this process, as ``dlrmflow train`` does with one trainer. The
clusters are up together, so every round runs every (W, rate, mode) point in one rotated order (no
point always first; the machine's load drifts). Configurations, data and the plan are
benchmarks/train.py's (``--configs``: the Criteo architecture, the embedding-bound one); the oracle
of W trainers (Bagpipe's LRPP) reads the same plan of the global batch as one trainer's.

A warm-up round (discarded) runs every (W, mode) once unshaped: it starts the workers' imports and
gives each point's bytes (deterministic), so that a rate at which a W's ``remote`` traffic would take
longer than ``--max-transfer-s`` is skipped for that W, and said so. The link is unshaped once the
last iteration is timed (the final flush, the evaluation and the final state's read are not part of
an iteration's time).

Per (config, rate, W, mode): the median and 10th percentile of every iteration of every round (rank
0's iterations for W > 1: each waits for the others at every step), samples/s (the global batch over
the median), the stall (share of iteration time waiting for embedding traffic), the share spent in
the row gradients' collectives and barriers (W > 1), bytes fetched from and written back to the
servers per iteration (summed over the trainers), the time the larger direction needs at the rate,
and growth against W = 1 at the same (rate, mode): server bytes per global batch and samples/s.
Per (config, W, mode): the bytes the trainers send each other per iteration, by kind (dense
gradients, row gradients, sync_now, sync_later, prefetched rows), and per trainer the most rows its
cache held and what it received from the other trainers and from the servers, with ``oracle-every``
(every LRPP trainer holding every cached row: LRPP before issue 33) beside the oracle, and the oracle's
peak replayed from the plan and batches apart from the run. Then the issues' goals, each against the
measured numbers.

Every run of one W must end in the same final state (SHA-256) as that W's ``remote`` (the reference;
W trainers average per-slice gradients, so different W end in different states): MISMATCH is
printed and the exit status is 1 otherwise. A plot (PNG) shows samples/s and server bytes per global
batch against W.

    .venv/bin/python benchmarks/trainers.py [--trainers 1,2] [--rates unshaped,20] [--configs a]
        [--modes remote,lru,oracle,oracle-every] [--iterations 20] [--repeats 2] [--json] [--plot FILE] [--no-link]
        [--device cuda]

Needs root or CAP_NET_ADMIN (network namespaces, tc); without them it says so in one line and exits 2.
``--no-link --rates unshaped`` needs neither: its clusters are plain LocalClusters.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from distributed import Client
from network import UNSHAPED, log, parse_rates, rate_label, rotated, transfer_seconds
from train import CONFIGS, EVAL_BATCHES, combine, config_data

from dlrmflow.engine.batch_stream import BatchStream, global_ids
from dlrmflow.engine.planning.holders import HolderCounts, holder_counts
from dlrmflow.engine.serving.cluster import ShapedCluster, local_cluster, shaped_cluster
from dlrmflow.engine.serving.shaped_link import LinkUnavailableError
from dlrmflow.engine.training.config import TrainConfig
from dlrmflow.engine.training.job import train
from dlrmflow.engine.training.run_setup import prepare_run

# oracle-every: the oracle with every LRPP trainer holding every cached row (before Bagpipe's saving), the
# baseline of the memory table; with one trainer it is the oracle, and is not run.
SERVER_MODES = ("remote", "lru", "oracle", "oracle-every")
BETWEEN_KINDS = ("dense gradients", "row gradients", "sync_now", "sync_later", "prefetched rows")
DEFAULT_RATES = f"{UNSHAPED},20"
STALL_GOAL = 0.05
SPEEDUP_GOAL = 1.6
LINK_BOUND_STALL = 0.5  # W = 1 counts as link-bound where it waits at least this share
PEAK_SHARE_GOAL = 0.6  # issue 33: a W = 2 trainer's cache peak against W = 1's


def parse_trainers(text: str, configs: list[str]) -> list[int]:
    """``1,2`` -> ``[1, 2]``: distinct counts >= 1 that divide every configuration's batch (SystemExit otherwise)."""
    counts: list[int] = []
    for part in text.split(","):
        try:
            w = int(part)
        except ValueError:
            w = 0
        if w < 1:
            raise SystemExit(f"--trainers: {part.strip()!r} is not a trainer count >= 1")
        for key in configs:
            if CONFIGS[key]["batch"] % w:
                raise SystemExit(f"--trainers: config {key}'s batch {CONFIGS[key]['batch']} does not split into {w} "
                                 "equal slices")
        if w not in counts:
            counts.append(w)
    return sorted(counts)


class NoLink:
    """``--no-link``: nothing between the trainers and the servers (a machine without network namespaces)."""

    root_veth = namespace = "nothing"

    def set_rate(self, rate: int | None) -> None:
        if rate is not None:
            raise ValueError("--no-link runs unshaped only")

    def sent_bytes(self) -> dict[str, int]:
        return {}


@contextlib.contextmanager
def plain_cluster(n_servers: int, trainers: int):
    """A LocalCluster of ``n_servers`` server workers (and ``trainers`` trainer workers), shaped like a
    :class:`ShapedCluster` without a link."""
    with local_cluster(n_servers, trainers=trainers) as cluster:
        with Client(cluster) as client:
            servers = sorted(a for a, w in client.scheduler_info()["workers"].items() if not w.get("resources"))
        yield ShapedCluster(cluster.scheduler_address, NoLink(), servers)


def train_point(data: dict[str, Any], trainers: int, mode: str, cluster: ShapedCluster, mbit: float | None,
                args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One run of ``mode`` with ``trainers`` trainers and ``cluster``'s link at ``mbit``: its summary plus the
    per-iteration times that benchmarks/train.py's ``combine`` pools.

    The run gets a client of its own, the newest in this process: the embedding servers' actor handles
    in this process bind to Dask's default client (the newest one), not to the client ``train`` gets,
    and with several clusters up an older client's run would ask the wrong scheduler about its servers."""
    cfg, iterations, link = data["cfg"], data["iterations"], cluster.link
    oracle = mode.startswith("oracle")
    config = TrainConfig(
        dataset_dir=str(data["dataset"]), mode="oracle" if oracle else mode,
        output_dir=str(work / f"run-{data['key']}-w{trainers}-{mode}"),
        batch_size=cfg["batch"], iterations=iterations, num_shards=args.shards, trainers=trainers,
        capacity=data["slots"] if mode == "lru" else None,
        plan_dir=str(data["plan_dir"]) if oracle else None,
        embedding_dim=cfg["dim"], bottom_mlp=cfg["bottom"], top_mlp=cfg["top"], device=args.device,
        eval_fraction=EVAL_BATCHES / (iterations + EVAL_BATCHES), metrics_every=iterations, save_state=False)
    link.set_rate(None if mbit is None else int(mbit * 1e6))
    before = link.sent_bytes()
    link_bytes: dict[str, int] = {}

    def unshape_after_the_last_iteration(done: int, total: int) -> None:
        if done == total and not link_bytes:
            link_bytes.update({k: v - before[k] for k, v in link.sent_bytes().items()})
            link.set_rate(None)

    with Client(cluster.address, direct_to_workers=True) as client:
        start = time.perf_counter()
        setup = prepare_run(config, plan=data["plan"] if oracle else None)
        setup.every_trainer_holds_every_row = mode == "oracle-every"
        summary = train(config, client=client, progress=unshape_after_the_last_iteration, setup=setup)
        wall = time.perf_counter() - start
    link.set_rate(None)
    per_it = np.loadtxt(Path(config.output_dir) / "iterations.csv", delimiter=",", skiprows=1, ndmin=2)
    steady = per_it[len(per_it) // 2:]
    group = summary.pop("trainers", None)
    between = dict.fromkeys(BETWEEN_KINDS, 0) | (group["bytes_between_trainers"] if group else {})
    summary.update(config=data["key"], mode=mode, rate_mbit=mbit, trainers=trainers, wall_seconds=wall,
                   steady_iteration_ms=float(steady[:, 2].mean()),
                   steady_stall_fraction=float(steady[:, 3].sum() / steady[:, 2].sum()),
                   iteration_ms=per_it[:, 2].tolist(), stall_ms=per_it[:, 3].tolist(),
                   bytes_between_trainers=between, sync_fraction=group["sync_fraction"] if group else 0.0,
                   per_trainer=group["per_trainer"] if group else [],
                   phases_ms=_phases_ms(group, iterations),
                   link_bytes=link_bytes.get("inside", 0) + link_bytes.get("root", 0))
    log(f"[{data['key']}] {rate_label(mbit):>14} W={trainers} {mode:<7} "
        f"median {summary['median_iteration_ms']:8.1f} ms, stall {100 * summary['stall_fraction']:5.1f}%, "
        f"sync {100 * summary['sync_fraction']:5.1f}%, run {wall:.1f} s")
    return summary


PHASES = ("compute", "dense_sync", "sync", "stall", "batches")


def _phases_ms(group: dict | None, iterations: int) -> dict[str, float]:
    """Rank 0's ms per iteration in each phase (W > 1): forward and backward, the dense gradients' gather
    (waiting for the slowest trainer included), the row gradients' sync, the stall, reading and splitting
    the global batch."""
    if not group:
        return {}
    lead = group["per_trainer"][0]
    return {phase: 1e3 * lead[f"{phase}_seconds"] / iterations for phase in PHASES}


def combine_point(key: str, mode: str, runs: list[dict]) -> dict:
    """train.py's ``combine`` (pooled medians, deterministic fields checked equal across rounds), plus the
    median sync share and the trainers' traffic, checked equal across rounds too."""
    if len({json.dumps(r["bytes_between_trainers"], sort_keys=True) for r in runs}) != 1:
        raise RuntimeError(f"[{key}] W={runs[0]['trainers']} {mode}: bytes between trainers differ between rounds")
    sync = float(np.median([r["sync_fraction"] for r in runs]))
    link_bytes = [r["link_bytes"] for r in runs]
    row = combine(key, mode, runs)
    phases = {p: float(np.median([r["phases_ms"][p] for r in runs])) for p in PHASES} if runs[0]["phases_ms"] else {}
    row.update(sync_fraction=sync, link_bytes_each_round=link_bytes, phases_ms=phases)
    return row


def run_config(data: dict[str, Any], rates: list[float | None], counts: list[int], modes: list[str],
               args: argparse.Namespace, work: Path) -> tuple[list[dict], list[dict]]:
    """Every point of one config: (combined rows per (rate, W, mode), skipped points with the reason)."""
    key = data["key"]
    runs: dict[tuple[float | None, int, str], list[dict]] = {}
    skipped: list[dict] = []
    with contextlib.ExitStack() as stack:
        clusters: dict[int, ShapedCluster] = {}
        for w in counts:
            start = plain_cluster if args.no_link else shaped_cluster
            cluster = stack.enter_context(start(None, n_servers=args.shards, trainers=w if w > 1 else 0)
                                          if not args.no_link else start(args.shards, w if w > 1 else 0))
            clusters[w] = cluster
            log(f"[{key}] W={w}: {args.shards} embedding servers at {', '.join(cluster.servers)} behind "
                f"{cluster.link.root_veth} <-> {cluster.link.namespace}"
                + (f"; {w} trainer workers" if w > 1 else "; the trainer in this process"))
        warm = {(w, m): train_point(data, w, m, clusters[w], None, args, work) for w in counts for m in modes
                if not (w == 1 and m == "oracle-every")}
        points: list[tuple[float | None, int, str]] = []
        for mbit in rates:
            for w in counts:
                need = transfer_seconds(warm[w, "remote"], mbit) if "remote" in modes else 0.0
                if need > args.max_transfer_s:
                    skipped.append({"config": key, "rate_mbit": mbit, "trainers": w, "reason": (
                        f"remote's traffic would take {need:.0f} s per run at {rate_label(mbit)} "
                        f"(> --max-transfer-s {args.max_transfer_s:g})")})
                    log(f"[{key}] {rate_label(mbit)} W={w}: skipped, {skipped[-1]['reason']}")
                    continue
                points += [(mbit, w, m) for m in modes if not (w == 1 and m == "oracle-every")]
        for round_ in range(args.repeats):
            for mbit, w, mode in rotated(points, round_ * max(1, len(points) // args.repeats)):
                runs.setdefault((mbit, w, mode), []).append(
                    train_point(data, w, mode, clusters[w], mbit, args, work))
    rows = [combine_point(key, mode, each) for (_, _, mode), each in runs.items()]
    rules = {w: holders_rule(data, w) for w in counts if "oracle" in modes}
    for r in rows:
        if r["mode"] == "oracle":  # the replay of what its trainers hold (engine/planning/holders.py)
            counts_w = rules[r["trainers"]]
            r["holders_rule"] = {"peak_per_trainer": counts_w.peak_holders_only, "mean_holders": counts_w.mean_holders,
                                 "peak_every_row": counts_w.peak_every_row}
    return rows, skipped


def holders_rule(data: dict[str, Any], size: int) -> HolderCounts:
    """Per trainer, the rows the oracle's W-trainer cache holds (Bagpipe's rule: only the rows its slice uses in
    their lifetime; engine/planning/holders.py), replayed on the plan and the batches apart from the run."""
    plan = data["plan"]
    stream = BatchStream(data["dataset"], data["cfg"]["batch"], sparse_only=True)
    batches = (global_ids(b.sparse, stream.offsets) for b in stream.iter_range(0, data["iterations"]))
    return holder_counts(plan.iterations(), batches, size=size, distance=plan.config.prefetch_distance,
                         iterations=data["iterations"])


def add_rates(rows: list[dict]) -> None:
    """Per row: samples/s, server bytes per iteration, the link's time for them, and growth against W = 1."""
    for r in rows:
        n = r["iterations"]
        r["samples_per_s"] = r["batch_size"] / (r["pooled_median_ms"] / 1e3)
        r["fetched_per_iteration"] = r["bytes_fetched"] / n
        r["written_per_iteration"] = r["bytes_written_back"] / n
        r["server_bytes_per_iteration"] = (r["bytes_fetched"] + r["bytes_written_back"]) / n
        r["link_ms_per_iteration"] = None if r["rate_mbit"] is None else 1e3 * transfer_seconds(r, r["rate_mbit"]) / n
        r["between_per_iteration"] = {k: v / n for k, v in r["bytes_between_trainers"].items()}
    one = {(r["config"], r["rate_mbit"], r["mode"]): r for r in rows if r["trainers"] == 1}
    for r in rows:
        base = one.get((r["config"], r["rate_mbit"], r["mode"]))
        r["server_bytes_vs_w1"] = base and r["server_bytes_per_iteration"] / base["server_bytes_per_iteration"]
        r["fetched_vs_w1"] = base and r["fetched_per_iteration"] / base["fetched_per_iteration"]
        r["samples_per_s_vs_w1"] = base and r["samples_per_s"] / base["samples_per_s"]


def state_mismatches(rows: list[dict]) -> list[str]:
    """One line per run whose final state differs from its (config, W)'s ``remote`` (or from each other
    when ``remote`` did not run)."""
    out = []
    for key, w in sorted({(r["config"], r["trainers"]) for r in rows}):
        mine = [r for r in rows if (r["config"], r["trainers"]) == (key, w)]
        ref = next((r for r in mine if r["mode"] == "remote"), mine[0])
        for r in mine:
            if r["state_sha256"] != ref["state_sha256"]:
                out.append(f"MISMATCH [{key}] W={w} {r['mode']} at {rate_label(r['rate_mbit'])}: final state "
                           f"{r['state_sha256'][:16]}... != {ref['mode']} at {rate_label(ref['rate_mbit'])}'s "
                           f"{ref['state_sha256'][:16]}...")
    return out


def _sort_key(r: dict) -> tuple:
    return r["config"], -(r["rate_mbit"] or float("inf")), r["trainers"], SERVER_MODES.index(r["mode"])


def _fmt(value: float | None, spec: str) -> str:
    return "n/a".rjust(int(spec.split(".")[0])) if value is None else format(value, spec)


def print_tables(rows: list[dict], skipped: list[dict], mismatches: list[str], load: tuple[float, float]) -> None:
    print(f"machine: {os.cpu_count()} CPUs; load average {load[0]:.1f} at the start, {load[1]:.1f} at the end "
          "(other work on these cores slows W = 1's two-thread trainer most)")
    header = (f"{'cfg':<4}{'link':>13}{'W':>3} {'mode':<7}{'median ms':>10}{'p10 ms':>8}{'samples/s':>10}"
              f"{'stall %':>8}{'sync %':>7}{'fetch KB/it':>12}{'write KB/it':>12}{'link ms/it':>11}"
              f"{'server x W1':>12}{'fetch x W1':>11}{'samples x W1':>13}")
    print("\n" + header + "\n" + "-" * len(header))
    for r in sorted(rows, key=_sort_key):
        print(f"{r['config']:<4}{rate_label(r['rate_mbit']):>13}{r['trainers']:>3} {r['mode']:<7}"
              f"{r['pooled_median_ms']:10.1f}{r['pooled_p10_ms']:8.1f}{r['samples_per_s']:10.0f}"
              f"{100 * r['pooled_stall_fraction']:8.1f}{100 * r['sync_fraction']:7.1f}"
              f"{r['fetched_per_iteration'] / 1e3:12.1f}{r['written_per_iteration'] / 1e3:12.1f}"
              f"{_fmt(r['link_ms_per_iteration'], '11.1f')}{_fmt(r['server_bytes_vs_w1'], '11.2f')}x"
              f"{_fmt(r['fetched_vs_w1'], '10.2f')}x{_fmt(r['samples_per_s_vs_w1'], '12.2f')}x")
    print("median / p10: over every iteration of every round (rank 0's for W > 1); samples/s: global batch / median;\n"
          "stall: waiting for embedding traffic; sync: in the row gradients' collectives and barriers (rank 0);\n"
          "fetch / write: bytes between the trainers and the servers per iteration, summed over trainers;\n"
          "link ms/it: the larger direction's bytes per iteration at the rate; x W1: against W = 1 at the same\n"
          "rate and mode (server: fetched + written per global batch)")
    header = f"{'cfg':<4}{'W':>3} {'mode':<7}" + "".join(f"{k + ' KB/it':>22}" for k in BETWEEN_KINDS)
    print("\n" + header + "\n" + "-" * len(header))
    seen = set()
    for r in sorted(rows, key=_sort_key):
        if (r["config"], r["trainers"], r["mode"]) in seen or r["trainers"] == 1:
            continue
        seen.add((r["config"], r["trainers"], r["mode"]))
        print(f"{r['config']:<4}{r['trainers']:>3} {r['mode']:<7}"
              + "".join(f"{r['between_per_iteration'].get(k, 0) / 1e3:22.1f}" for k in BETWEEN_KINDS))
    print("bytes the trainers send each other per iteration (each trainer's sends to the W - 1 others, summed);\n"
          "the same at every rate")
    print_memory(rows)
    header = f"{'cfg':<4}{'link':>13}{'W':>3} {'mode':<7}{'median ms':>10}"
    header += "".join(f"{p + ' ms':>14}" for p in PHASES)
    print("\n" + header + "\n" + "-" * len(header))
    for r in sorted(rows, key=_sort_key):
        if r["phases_ms"]:
            print(f"{r['config']:<4}{rate_label(r['rate_mbit']):>13}{r['trainers']:>3} {r['mode']:<7}"
                  f"{r['pooled_median_ms']:10.1f}" + "".join(f"{r['phases_ms'][p]:14.1f}" for p in PHASES))
    print("where trainer 0's iteration goes (W > 1; ms per iteration, medians over rounds): forward and backward,\n"
          "the dense gradients' gather (its wait for the slowest trainer included), the row gradients' sync, the\n"
          "stall, and reading and splitting the global batch (between iterations)")
    for s in skipped:
        print(f"[{s['config']}] {rate_label(s['rate_mbit'])} W={s['trainers']}: skipped: {s['reason']}")
    for line in goals(rows):
        print(line)
    print(*(mismatches or [f"final state: every mode at every rate the same as remote's, for each W "
                           f"({', '.join(sorted({str(r['trainers']) for r in rows}))})"]), sep="\n")


def memory(r: dict) -> dict[str, float]:
    """Per trainer (the largest, and the mean over trainers of the traffic): the most rows its cache held at
    once, and the bytes it received per iteration from the other trainers and from the servers."""
    trainers = r["per_trainer"] or [{"peak_cached_rows": r["peak_cached_rows"], "bytes_from_trainers": 0,
                                     "bytes_from_servers": r["bytes_fetched"]}]
    n = r["iterations"]
    return {"peak": max(t["peak_cached_rows"] for t in trainers),
            "from_trainers": float(np.mean([t["bytes_from_trainers"] for t in trainers])) / n,
            "from_servers": float(np.mean([t["bytes_from_servers"] for t in trainers])) / n}


ROW_KINDS = ("prefetched rows", "sync_now", "sync_later")  # what the trainers send each other about rows


def row_bytes_between(r: dict) -> float:
    """Bytes per iteration the trainers send each other about embedding rows (the rows and their gradients)."""
    return sum(r["bytes_between_trainers"].get(k, 0) for k in ROW_KINDS) / r["iterations"]


def print_memory(rows: list[dict]) -> None:
    header = (f"{'cfg':<4}{'W':>3} {'mode':<13}{'peak cached rows':>18}{'x W=1':>7}{'from trainers KB/it':>21}"
              f"{'from servers KB/it':>20}{'row traffic KB/it':>19}{'replayed peak':>15}{'holders/row':>12}")
    print("\n" + header + "\n" + "-" * len(header))
    w1 = {(r["config"], r["mode"]): memory(r)["peak"] for r in rows if r["trainers"] == 1}
    seen = set()
    for r in sorted(rows, key=_sort_key):
        if (r["config"], r["trainers"], r["mode"]) in seen or r["mode"] == "remote":
            continue
        seen.add((r["config"], r["trainers"], r["mode"]))
        m, base = memory(r), w1.get((r["config"], "oracle" if r["mode"].startswith("oracle") else r["mode"]))
        rule = r.get("holders_rule")
        ruled = "" if rule is None else f"{max(rule['peak_per_trainer']):15,d}{rule['mean_holders']:12.2f}"
        print(f"{r['config']:<4}{r['trainers']:>3} {r['mode']:<13}{m['peak']:18,d}"
              f"{_fmt(m['peak'] / base if base else None, '7.2f')}{m['from_trainers'] / 1e3:21.1f}"
              f"{m['from_servers'] / 1e3:20.1f}{row_bytes_between(r) / 1e3:19.1f}" + ruled)
    print("per trainer: the most rows its cache held at once (the oracle's: as its prefetch worker places them, the\n"
          "next P iterations' rows included; the largest over trainers), and the bytes it received per iteration\n"
          "from the other trainers (rows, row and dense gradients) and from the servers (means over trainers);\n"
          "row traffic: what all trainers sent each other about rows (prefetched rows, their gradients) per\n"
          "iteration; oracle: a trainer holds the rows its slice uses in their cache lifetime (Bagpipe's LRPP);\n"
          "oracle-every: every trainer holds every cached row (before it); replayed peak: the oracle's per-trainer\n"
          "peak replayed from the plan and batches apart from the run (engine/planning/holders.py), and the\n"
          "trainers per prefetched row (W for oracle-every)")


def goals(rows: list[dict]) -> list[str]:
    """The issue's goals, each judged on the measured rows."""
    out = ["", "goals (issues 22 and 33):"]
    cores = os.cpu_count() or 1
    by = {(r["config"], r["rate_mbit"], r["trainers"], r["mode"]): r for r in rows}
    wide = [r for r in rows if r["trainers"] > 1]
    for r in sorted(wide, key=_sort_key):
        if r["mode"] == "remote" or r["server_bytes_vs_w1"] is None:
            continue
        if r["mode"] == "oracle":
            verdict = "met" if r["server_bytes_vs_w1"] <= 1.0 + 1e-9 else "NOT met"
            out.append(f"  [{r['config']}] {rate_label(r['rate_mbit'])} W={r['trainers']}: LRPP server bytes "
                       f"per global batch {r['server_bytes_vs_w1']:.2f}x W=1's (fetched {r['fetched_vs_w1']:.2f}x); "
                       f"flat in W: {verdict}")
        else:
            out.append(f"  [{r['config']}] {rate_label(r['rate_mbit'])} W={r['trainers']}: lru (independent caches) "
                       f"server bytes {r['server_bytes_vs_w1']:.2f}x W=1's (fetched {r['fetched_vs_w1']:.2f}x)")
    for r in sorted(wide, key=_sort_key):
        base = by.get((r["config"], r["rate_mbit"], 1, r["mode"]))
        if base is None:
            continue
        # The goal holds where the link bounds W = 1: where it waits for embedding traffic most of its iteration.
        link_bound = base["rate_mbit"] is not None and base["pooled_stall_fraction"] >= LINK_BOUND_STALL
        ratio = r["samples_per_s_vs_w1"]
        verdict = ("met" if ratio >= SPEEDUP_GOAL else "NOT met") if link_bound else "does not apply"
        link_ms = "" if base["link_ms_per_iteration"] is None else \
            f", its bytes need {base['link_ms_per_iteration']:.0f} ms/it at the rate"
        out.append(f"  [{r['config']}] {rate_label(r['rate_mbit'])} W={r['trainers']} {r['mode']:<7} samples/s "
                   f"{ratio:.2f}x W=1's (goal >= {SPEEDUP_GOAL}x where the link bounds W=1: {verdict}); W=1 waits "
                   f"{100 * base['pooled_stall_fraction']:.0f}% of its {base['pooled_median_ms']:.0f} ms{link_ms}")
    for r in sorted(rows, key=_sort_key):
        if r["mode"] == "oracle":
            stall = r["pooled_stall_fraction"]
            verdict = "met" if stall < STALL_GOAL else "NOT met"
            out.append(f"  [{r['config']}] {rate_label(r['rate_mbit'])} W={r['trainers']} oracle stall "
                       f"{100 * stall:.1f}% (goal < {100 * STALL_GOAL:.0f}%: {verdict})")
    w1 = {r["config"]: memory(r)["peak"] for r in rows if r["trainers"] == 1 and r["mode"] == "oracle"}
    every = {(r["config"], r["trainers"]): r for r in rows if r["mode"] == "oracle-every"}
    seen = set()
    for r in sorted(rows, key=_sort_key):
        if r["mode"] != "oracle" or r["trainers"] == 1 or (r["config"], r["trainers"]) in seen:
            continue
        seen.add((r["config"], r["trainers"]))
        if r["trainers"] == 2 and w1.get(r["config"]):
            share = memory(r)["peak"] / w1[r["config"]]
            out.append(f"  [{r['config']}] W=2 oracle peak cached rows per trainer {100 * share:.0f}% of W=1's "
                       f"(issue 33: at most {100 * PEAK_SHARE_GOAL:.0f}%: "
                       f"{'met' if share <= PEAK_SHARE_GOAL else 'NOT met'})")
        base = every.get((r["config"], r["trainers"]))
        if base is not None:
            rows_of = [x["bytes_between_trainers"]["prefetched rows"] for x in (r, base)]
            handed = 1 - rows_of[0] / rows_of[1]
            skipped = 1 - r["holders_rule"]["mean_holders"] / r["trainers"]
            cut = 1 - row_bytes_between(r) / row_bytes_between(base)
            out.append(f"  [{r['config']}] W={r['trainers']} oracle: prefetched rows between trainers "
                       f"{100 * handed:.1f}% below oracle-every's, a trainer holding {100 * (1 - skipped):.1f}% of "
                       f"them (issue 33: down by the share it skips, {100 * skipped:.1f}%); with the row gradients "
                       f"{100 * cut:.1f}% below")
    most = max((r["trainers"] for r in rows), default=1)
    out.append(f"  cores: {cores}; W={most} runs {most} trainer processes of {max(1, cores // most)} thread(s) each, "
               f"beside the embedding servers, on these {cores} cores, and all trainers share one link")
    return out


def plot(rows: list[dict], path: Path) -> Path:
    """Per config: samples/s against W (one line per mode and rate; solid unshaped, dashed shaped), and
    server bytes per global batch against W per mode (the same at every rate: the first rate's)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({r["config"] for r in rows})
    fig, axes = plt.subplots(len(keys), 2, figsize=(12, 4.5 * len(keys)), squeeze=False)
    colours = dict(zip(SERVER_MODES, ("tab:blue", "tab:orange", "tab:green", "tab:olive"), strict=True))
    styles = ["-", "--", ":", "-."]
    for (speed, traffic), key in zip(axes, keys, strict=True):
        rates = sorted({r["rate_mbit"] for r in rows if r["config"] == key}, key=lambda m: -(m or float("inf")))
        counts = sorted({r["trainers"] for r in rows if r["config"] == key})
        for mode in SERVER_MODES:
            for i, mbit in enumerate(rates):
                mine = sorted((r for r in rows if (r["config"], r["mode"], r["rate_mbit"]) == (key, mode, mbit)),
                              key=lambda r: r["trainers"])
                if not mine:
                    continue
                speed.plot([r["trainers"] for r in mine], [r["samples_per_s"] for r in mine], marker="o",
                           color=colours[mode], ls=styles[i % len(styles)], label=f"{mode}, {rate_label(mbit)}")
                if i == 0:
                    traffic.plot([r["trainers"] for r in mine], [r["server_bytes_per_iteration"] / 1e3 for r in mine],
                                 marker="o", color=colours[mode], label=mode)
        for ax in (speed, traffic):
            ax.set_xticks(counts)
            ax.set_xlabel("trainers (W)")
            ax.grid(True, alpha=0.3)
            ax.legend()
            ax.set_ylim(bottom=0)
        speed.set_ylabel("samples/s (global batch / median iteration)")
        speed.set_title(f"({key}) {CONFIGS[key]['name']}: throughput")
        traffic.set_ylabel("server bytes per global batch (KB, fetched + written)")
        traffic.set_title(f"({key}) traffic between trainers and servers")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parse_choices(args: argparse.Namespace) -> tuple[list[str], list[str], list[int], list[float | None]]:
    """(configs, modes, trainer counts, rates) from the options; SystemExit with one line for a bad one."""
    configs = [k.strip() for k in args.configs.split(",")]
    if unknown := set(configs) - set(CONFIGS):
        raise SystemExit(f"--configs: unknown {sorted(unknown)}; choose from {', '.join(CONFIGS)}")
    modes = [m.strip() for m in args.modes.split(",")]
    if unknown := set(modes) - set(SERVER_MODES):
        raise SystemExit(f"--modes: unknown {sorted(unknown)}; choose from {', '.join(SERVER_MODES)}")
    if args.iterations < 1 or args.repeats < 1:
        raise SystemExit("--iterations and --repeats must be at least 1")
    try:
        rates = parse_rates(args.rates)
    except ValueError:
        raise SystemExit(f"--rates: {args.rates!r} is not a list of rates in Mbit/s and 'unshaped'") from None
    if args.no_link and rates != [None]:
        raise SystemExit("--no-link runs without a link: use --rates unshaped")
    return configs, modes, parse_trainers(args.trainers, configs), rates


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="a", help="comma-separated: a (Criteo arch), b (embedding-bound); "
                                                       "default a")
    parser.add_argument("--trainers", default="1,2", help="comma-separated trainer counts W (default 1,2)")
    parser.add_argument("--rates", default=DEFAULT_RATES,
                        help=f"link rates in Mbit/s, 'unshaped' for none (default {DEFAULT_RATES})")
    parser.add_argument("--modes", default=",".join(SERVER_MODES),
                        help="comma-separated (default remote,lru,oracle,oracle-every)")
    parser.add_argument("--iterations", type=int, default=20, help="iterations per run (default 20)")
    parser.add_argument("--lookahead", type=int, default=20, help="L (default 20)")
    parser.add_argument("--distance", type=int, default=2, help="P (default 2)")
    parser.add_argument("--shards", type=int, default=2, help="embedding servers, one worker each (default 2)")
    parser.add_argument("--repeats", type=int, default=2, help="rounds of every point (default 2)")
    parser.add_argument("--max-transfer-s", type=float, default=120.0,
                        help="skip a (rate, W) where remote's traffic would take longer per run (default 120)")
    parser.add_argument("--no-link", action="store_true",
                        help="no emulated link: a LocalCluster (for --rates unshaped on a machine without network "
                             "namespaces)")
    parser.add_argument("--work-dir", default="/tmp/dlrmflow-bench-trainers")
    parser.add_argument("--plot", help="the PNG to write (default WORK_DIR/trainers.png)")
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON object instead of tables")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: every trainer on a GPU (W trainers share the GPUs this machine has)")
    args = parser.parse_args()
    try:
        configs, modes, counts, rates = parse_choices(args)
    except SystemExit as exc:  # a bad option: one line, status 2
        if not isinstance(exc.code, str):
            raise
        print(f"trainers.py: {exc.code}", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("trainers.py: --device cuda: no CUDA GPU is available", file=sys.stderr)
        return 2
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    load_at_start = os.getloadavg()[0]
    log(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), load average {load_at_start:.1f}"
        + (f", trainers on {torch.cuda.device_count()} x {torch.cuda.get_device_name()}" if args.device == "cuda"
           else ""))
    rows, skipped = [], []
    try:
        for key in configs:
            data = config_data(key, args, work)
            data["slots"] = data["plan"].num_slots
            log(f"[{key}] {data['cfg']['name']}: batch {data['cfg']['batch']}, {data['iterations']} iterations, "
                f"plan L={args.lookahead} P={args.distance}: {data['slots']:,} cache slots")
            more, skip = run_config(data, rates, counts, modes, args, work)
            rows += more
            skipped += skip
    except LinkUnavailableError as exc:
        print(f"trainers.py: {exc}", file=sys.stderr)
        return 2
    load = (load_at_start, os.getloadavg()[0])
    log(f"load average at the end: {load[1]:.1f}")
    add_rates(rows)
    mismatches = state_mismatches(rows)
    png = plot(rows, Path(args.plot) if args.plot else work / "trainers.png")
    if args.json:
        print(json.dumps({"machine": {"cpus": os.cpu_count(), "load_average": load},
                          "runs": sorted(rows, key=_sort_key), "skipped": skipped, "goals": goals(rows)[2:],
                          "mismatches": mismatches, "plot": str(png)}, indent=2, default=str))
        for line in mismatches:
            print(line, file=sys.stderr)
    else:
        print_tables(rows, skipped, mismatches, load)
        print(f"plot: {png}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
