"""Training speed of the four modes with the embedding servers behind an emulated network link, by link rate.

The servers are Dask workers inside a network namespace joined to this one by a veth pair shaped
with tbf at each rate (:func:`dlrmflow.engine.serving.cluster.shaped_cluster`); the trainer runs here, so
every fetch and write-back crosses the link. One link serves every run of a configuration, its rate
set before each run. Configurations, data and the plan are benchmarks/train.py's (``--configs a,b``:
the Criteo architecture, the embedding-bound one; ``demo``: make run's data; ``skewed``: the Criteo
architecture on small, strongly skewed tables, where the oracle fetches 3.4x fewer bytes than ``remote``; ``c``:
MLPerf-like rows of dim 128 on tiny skewed tables, where it fetches 16x fewer over 50 iterations).

Each round runs every (rate, mode) point once, in an order rotated from round to round (no point
always first; the machine's load drifts); ``local`` does not use the link and runs once per round.
A warm-up round (discarded) runs each remote mode once unshaped: it starts the servers' imports and
gives each mode's bytes per run (deterministic), so that a point whose ``remote`` traffic would take
longer than ``--max-transfer-s`` at its rate is skipped, and said so.

The link is shaped during the training loop; once the last iteration is timed it is unshaped, so the
oracle's final flush, the evaluation and the final state's read (which the SHA-256 check needs) do not
take minutes at the slow rates. None of them is part of an iteration's time.

Per (config, rate, mode): the median and 10th percentile of every iteration of every round, the stall
(share of iteration time spent waiting for embedding traffic; ``remote``'s is the share of its
iteration spent on embedding traffic), bytes fetched and written back, the frames the link
carried, and the CPU milliseconds per iteration of this process (trainer, Dask client and scheduler)
and of the servers, over the second half of the iterations (median over the rounds).
Per (config, rate): oracle vs remote and vs local (medians), and the physical limit of the
oracle's speed-up, remote / max(local, the oracle's bytes per iteration / rate) (it can hide traffic
behind compute, not beat either; each direction has the full rate, so the bytes are the larger of
fetched and written back), with the speed-up as a share of it. Every run of a configuration must end
in the same final state (SHA-256); the exit status is 1 otherwise. A plot (PNG) shows iteration time
against link rate per mode.

    .venv/bin/python benchmarks/network.py [--configs a,b] [--rates unshaped,1000,200,100,50,20,10]
        [--modes local,remote,lru,oracle] [--repeats 3] [--iterations N] [--json] [--plot FILE]

Needs root or CAP_NET_ADMIN (network namespaces, tc); without them it says so in one line and exits 2.
"""

from __future__ import annotations

# isort: off
# First: importing dlrmflow sets OMP_WAIT_POLICY=PASSIVE, which libgomp reads once, when torch loads; torch
# loaded first would spin its threads between parallel regions and collapse every mode on a busy machine
# (docs/oracle-overhead.md). A value in the environment still wins.
import dlrmflow  # noqa: F401
# isort: on
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
from train import CONFIGS, EVAL_BATCHES, MODES, combine, config_data

from dlrmflow.engine.serving.cluster import shaped_cluster
from dlrmflow.engine.serving.shaped_link import LinkUnavailableError, ShapedLink
from dlrmflow.engine.training.config import TrainConfig
from dlrmflow.engine.training.job import train

RATES = "unshaped,1000,200,100,50,20,10"
UNSHAPED = "unshaped"


def parse_rates(text: str) -> list[float | None]:
    """``unshaped,1000,20`` -> ``[None, 1000.0, 20.0]`` (Mbit/s; None: the same link without shaping)."""
    rates: list[float | None] = []
    for part in text.split(","):
        part = part.strip()
        if part in (UNSHAPED, "0"):
            rates.append(None)
        elif float(part) > 0:
            rates.append(float(part))
        else:
            raise SystemExit(f"--rates: {part!r} is not a positive rate in Mbit/s or 'unshaped'")
    return rates


def rate_label(mbit: float | None) -> str:
    return UNSHAPED if mbit is None else f"{mbit:g} Mbit/s"


def prepare(key: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """benchmarks/train.py's dataset and plan of config ``key``: paths, the plan's cache size, iterations."""
    data = config_data(key, args, work)
    cfg, meta = data["cfg"], data["meta"]
    log(f"[{key}] {cfg['name']}: {data['rows']:,} rows, {meta.total_embedding_rows:,} embedding rows of dim "
        f"{cfg['dim']}, batch {cfg['batch']}, {data['iterations']} iterations, plan L={args.lookahead} "
        f"P={args.distance}")
    return {**data, "slots": data["plan"].num_slots}


def server_cpu_seconds(client: Client | None, servers: list[str]) -> float:
    """CPU seconds the embedding-server processes have used so far (0 without servers)."""
    if client is None or not servers:
        return 0.0
    return float(sum(client.run(time.process_time, workers=servers).values()))


def train_point(data: dict[str, Any], mode: str, link: ShapedLink | None, mbit: float | None,
                args: argparse.Namespace, client: Client | None, work: Path,
                servers: list[str] | None = None) -> dict[str, Any]:
    """One training run of ``mode`` with the link at ``mbit``; the fields benchmarks/train.py's ``combine`` reads.

    CPU per iteration of the second half of the iterations (the steady state the medians also use): this
    process (the trainer, its threads and the Dask client and scheduler) and the servers together, read at
    the middle and the last iteration (the servers' read is one ``client.run``, a round trip in one
    iteration)."""
    servers = [] if mode == "local" else list(servers or [])
    cpu: dict[str, tuple[float, float, int]] = {}
    cfg, iterations = data["cfg"], data["iterations"]
    config = TrainConfig(
        dataset_dir=str(data["dataset"]), mode=mode, output_dir=str(work / f"run-{data['key']}-{mode}"),
        batch_size=cfg["batch"], iterations=iterations, num_shards=args.shards,
        capacity=data["slots"] if mode == "lru" else None,
        plan_dir=str(data["plan_dir"]) if mode == "oracle" else None, device=args.device,
        embedding_dim=cfg["dim"], bottom_mlp=cfg["bottom"], top_mlp=cfg["top"],
        eval_fraction=EVAL_BATCHES / (iterations + EVAL_BATCHES), metrics_every=iterations, save_state=False)
    link_bytes: dict[str, int] = {}
    if link is not None:
        link.set_rate(None if mbit is None else int(mbit * 1e6))
        before = link.sent_bytes()

    def unshape_after_the_last_iteration(done: int, total: int) -> None:
        if done in (total // 2, total) and total >= 2:
            cpu["mid" if done < total else "end"] = (time.process_time(), server_cpu_seconds(client, servers), done)
        if link is not None and done == total:
            link_bytes.update({k: v - before[k] for k, v in link.sent_bytes().items()})
            link.set_rate(None)

    start = time.perf_counter()
    summary = train(config, client=client if mode != "local" else None, progress=unshape_after_the_last_iteration)
    wall = time.perf_counter() - start
    per_it = np.loadtxt(Path(config.output_dir) / "iterations.csv", delimiter=",", skiprows=1, ndmin=2)
    steady = per_it[len(per_it) // 2:]
    summary.update(config=data["key"], rate_mbit=mbit, wall_seconds=wall,
                   steady_iteration_ms=float(steady[:, 2].mean()),
                   steady_stall_fraction=float(steady[:, 3].sum() / steady[:, 2].sum()),
                   iteration_ms=per_it[:, 2].tolist(), stall_ms=per_it[:, 3].tolist(),
                   link_bytes=link_bytes.get("inside", 0) + link_bytes.get("root", 0),
                   link_bytes_larger=max(link_bytes.values(), default=0))
    if "mid" in cpu and "end" in cpu:
        n = cpu["end"][2] - cpu["mid"][2]
        summary.update(trainer_cpu_ms=1e3 * (cpu["end"][0] - cpu["mid"][0]) / n,
                       servers_cpu_ms=1e3 * (cpu["end"][1] - cpu["mid"][1]) / n)
    log(f"[{data['key']}] {rate_label(mbit) if mode != 'local' else 'no link':>14} {mode:<7} "
        f"median {summary['median_iteration_ms']:8.1f} ms, stall {100 * summary['stall_fraction']:5.1f}%, "
        f"CPU/it trainer {summary.get('trainer_cpu_ms', float('nan')):.1f} ms servers "
        f"{summary.get('servers_cpu_ms', float('nan')):.1f} ms, run {wall:.1f} s")
    return summary


def rotated(items: list, by: int) -> list:
    by %= max(len(items), 1)
    return items[by:] + items[:by]


def transfer_seconds(run: dict[str, Any], mbit: float | None) -> float:
    """The time a run's embedding traffic needs at ``mbit`` (the larger direction; each has the full rate)."""
    if mbit is None:
        return 0.0
    return max(run["bytes_fetched"], run["bytes_written_back"]) * 8 / (mbit * 1e6)


def run_config(data: dict[str, Any], rates: list[float | None], modes: list[str], args: argparse.Namespace,
               work: Path) -> tuple[list[dict], list[dict]]:
    """Every point of one config: (combined rows per (rate, mode), skipped points with the reason)."""
    key = data["key"]
    remote_modes = [m for m in modes if m != "local"]
    runs: dict[tuple[float | None, str], list[dict]] = {}
    skipped: list[dict] = []
    with contextlib.ExitStack() as stack:
        link, client = None, None
        if remote_modes:
            cluster = stack.enter_context(shaped_cluster(None, n_servers=args.shards))
            client = stack.enter_context(Client(cluster.address, direct_to_workers=True))
            link = cluster.link
            if args.pin:
                for pid in client.run(os.getpid, workers=list(cluster.servers)).values():
                    pin_process(pid, args.pin[1])
                log(f"[{key}] pinned: this process on CPUs {sorted(args.pin[0])}, the servers on {sorted(args.pin[1])}")
            log(f"[{key}] {args.shards} embedding servers at {', '.join(cluster.servers)} behind "
                f"{link.root_veth} <-> {link.namespace}")
        servers = list(cluster.servers) if remote_modes else []
        warm = {m: train_point(data, m, link, None, args, client, work, servers) for m in remote_modes}
        points: list[tuple[float | None, str]] = [(None, "local")] if "local" in modes else []
        for mbit in rates:
            need = transfer_seconds(warm["remote"], mbit) if "remote" in warm else 0.0
            if need > args.max_transfer_s:
                skipped.append({"config": key, "rate_mbit": mbit, "reason": (
                    f"remote's traffic would take {need:.0f} s per run at {rate_label(mbit)} "
                    f"(> --max-transfer-s {args.max_transfer_s:g})")})
                log(f"[{key}] {rate_label(mbit)}: skipped, {skipped[-1]['reason']}")
                continue
            points += [(mbit, m) for m in remote_modes]
        for round_ in range(args.repeats):
            for mbit, mode in rotated(points, round_ * max(1, len(points) // args.repeats)):
                runs.setdefault((mbit, mode), []).append(
                    train_point(data, mode, link, mbit, args, client, work, servers))
    rows = []
    for (_, mode), each in runs.items():
        row = combine(key, mode, each)
        row["link_bytes_each_round"] = [r["link_bytes"] for r in each]
        row["link_larger_each_round"] = [r["link_bytes_larger"] for r in each]
        for field in ("trainer_cpu_ms", "servers_cpu_ms"):  # the median over the rounds
            row[field] = float(np.median([r[field] for r in each])) if all(field in r for r in each) else None
        rows.append(row)
    return rows, skipped


def compare(rows: list[dict]) -> list[dict]:
    """Per (config, rate): oracle vs remote and local, remote's stall, the limit of the speed-up and its share."""
    out = []
    local = {r["config"]: r for r in rows if r["mode"] == "local"}
    by_point: dict[tuple[str, float | None], dict[str, dict]] = {}
    for r in rows:
        if r["mode"] != "local":
            by_point.setdefault((r["config"], r["rate_mbit"]), {})[r["mode"]] = r
    for (key, mbit), modes in by_point.items():
        remote, oracle, loc = modes.get("remote"), modes.get("oracle"), local.get(key)
        point: dict[str, Any] = {"config": key, "rate_mbit": mbit,
                                 "remote_stall_fraction": remote and remote["pooled_stall_fraction"]}
        if remote and oracle:
            speedup = remote["pooled_median_ms"] / oracle["pooled_median_ms"]
            point["oracle_vs_remote"] = speedup
            if loc:
                per_iteration_s = transfer_seconds(oracle, mbit) / oracle["iterations"]
                bound_ms = max(loc["pooled_median_ms"], 1e3 * per_iteration_s)
                point.update(oracle_vs_local=oracle["pooled_median_ms"] / loc["pooled_median_ms"],
                             oracle_transfer_ms_per_iteration=1e3 * per_iteration_s,
                             speedup_limit=remote["pooled_median_ms"] / bound_ms)
                point["share_of_limit"] = speedup / point["speedup_limit"]
                wire = float(np.median(oracle.get("link_larger_each_round") or [0]))
                if mbit is not None and wire:
                    # What crossed the link's busier direction (rows, ids, framing, TCP/IP headers) at the rate.
                    wire_ms = 1e3 * wire * 8 / (mbit * 1e6) / oracle["iterations"]
                    point.update(oracle_wire_ms_per_iteration=wire_ms,
                                 wire_limit=remote["pooled_median_ms"] / max(loc["pooled_median_ms"], wire_ms))
                    point["share_of_wire_limit"] = speedup / point["wire_limit"]
        out.append(point)
    return sorted(out, key=lambda p: (p["config"], -(p["rate_mbit"] or float("inf"))))


def same_state(rows: list[dict]) -> dict[str, bool]:
    """Per config: whether every mode at every rate ended in the same final state."""
    return {key: len({r["state_sha256"] for r in rows if r["config"] == key}) == 1
            for key in sorted({r["config"] for r in rows})}


def print_table(rows: list[dict], points: list[dict], skipped: list[dict], same: dict[str, bool]) -> None:
    header = (f"{'cfg':<4}{'link':>15} {'mode':<8}{'median ms':>10}{'p10 ms':>9}{'stall %':>9}{'fetched MB':>12}"
              f"{'written MB':>12}{'link MB':>9}{'CPU trainer':>12}{'servers':>9}")
    print("\n" + header + "\n" + "-" * len(header))
    order = {m: i for i, m in enumerate(MODES)}
    for r in sorted(rows, key=lambda r: (r["config"], -(r["rate_mbit"] or float("inf")), order[r["mode"]])):
        link = "no link" if r["mode"] == "local" else rate_label(r["rate_mbit"])
        link_mb = np.median(r["link_bytes_each_round"]) / 1e6
        print(f"{r['config']:<4}{link:>15} {r['mode']:<8}{r['pooled_median_ms']:10.1f}{r['pooled_p10_ms']:9.1f}"
              f"{100 * r['pooled_stall_fraction']:9.1f}{r['bytes_fetched'] / 1e6:12.1f}"
              f"{r['bytes_written_back'] / 1e6:12.1f}{link_mb:9.1f}{_fmt(r.get('trainer_cpu_ms'), '12.1f')}"
              f"{_fmt(r.get('servers_cpu_ms'), '9.1f')}")
    header = (f"{'cfg':<4}{'link':>15}{'remote stall':>14}{'oracle/remote':>15}{'oracle/local':>14}"
              f"{'limit':>8}{'share':>8}{'wire limit':>12}{'share':>8}")
    print("\n" + header + "\n" + "-" * len(header))
    for p in points:
        share = p.get("share_of_limit")
        print(f"{p['config']:<4}{rate_label(p['rate_mbit']):>15}{_fmt(p['remote_stall_fraction'], '13.1%')}"
              f"{_fmt(p.get('oracle_vs_remote'), '14.2f')}x{_fmt(p.get('oracle_vs_local'), '13.2f')}x"
              f"{_fmt(p.get('speedup_limit'), '7.2f')}x{_fmt(share, '8.0%')}"
              f"{_fmt(p.get('wire_limit'), '11.2f')}x{_fmt(p.get('share_of_wire_limit'), '8.0%')}")
    print("oracle/remote: remote's median over the oracle's (the speed-up); oracle/local: the oracle's median over\n"
          "local's; limit: remote / max(local, the oracle's bytes per iteration / rate); share: speed-up / limit\n"
          "wire limit: the same with the bytes the link's busier direction carried in the oracle's runs (rows, ids,\n"
          "framing and headers) in place of its row bytes; share: speed-up / wire limit\n"
          "CPU trainer / servers: CPU ms per iteration of this process and of the servers together, second half "
          "of the iterations, median over the rounds")
    for s in skipped:
        print(f"[{s['config']}] {rate_label(s['rate_mbit'])}: skipped: {s['reason']}")
    for key, ok in same.items():
        print(f"[{key}] final state: {'the same in every mode at every rate' if ok else 'DIFFERENT between runs'}")


def _fmt(value: float | None, spec: str) -> str:
    return "n/a".rjust(int(spec.split(".")[0])) if value is None else format(value, spec)


def plot(rows: list[dict], path: Path) -> Path:
    """Median iteration time (p10 to median shaded) against link rate, one line per mode, one panel per config;
    the unshaped link sits right of the fastest rate, ``local`` is a horizontal line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({r["config"] for r in rows})
    fig, axes = plt.subplots(1, len(keys), figsize=(6.5 * len(keys), 4.5), squeeze=False)
    shaped = sorted({r["rate_mbit"] for r in rows if r["rate_mbit"] is not None})
    unshaped_x = 4 * shaped[-1] if shaped else 1.0
    for ax, key in zip(axes[0], keys, strict=True):
        for mode in MODES:
            mine = sorted((r for r in rows if r["config"] == key and r["mode"] == mode),
                          key=lambda r: r["rate_mbit"] or unshaped_x)
            if not mine:
                continue
            if mode == "local":
                ax.axhline(mine[0]["pooled_median_ms"], color="black", ls="--", lw=1, label="local (no link)")
                continue
            x = [r["rate_mbit"] or unshaped_x for r in mine]
            line, = ax.plot(x, [r["pooled_median_ms"] for r in mine], marker="o", label=mode)
            ax.fill_between(x, [r["pooled_p10_ms"] for r in mine], [r["pooled_median_ms"] for r in mine],
                            color=line.get_color(), alpha=0.15)
        ticks = [*shaped, unshaped_x]
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(ticks, [f"{t:g}" for t in shaped] + ["unshaped"])
        ax.minorticks_off()
        ax.set_xlabel("link rate (Mbit/s)")
        ax.set_ylabel("iteration time (ms, median; shaded: p10)")
        ax.set_title(f"({key}) {CONFIGS[key]['name']}")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parse_pin(text: str) -> tuple[set[int], set[int]]:
    """``1:0`` -> ({1}, {0}): the trainer's CPUs, then the servers' (``taskset`` lists: ``0-3``, ``0,2``)."""
    def cpus(part: str) -> set[int]:
        out: set[int] = set()
        for piece in part.split(","):
            low, _, high = piece.partition("-")
            out.update(range(int(low), int(high or low) + 1))
        return out

    trainer, sep, servers = text.partition(":")
    if not sep or not trainer or not servers:
        raise SystemExit(f"--pin: expected TRAINER_CPUS:SERVER_CPUS (for example 1:0), got {text!r}")
    return cpus(trainer), cpus(servers)


def pin_process(pid: int, cpus: set[int]) -> None:
    """Every thread of process ``pid`` on ``cpus`` (threads and processes it starts later inherit it)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), cpus)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="a,b", help="comma-separated: a (Criteo arch), b (embedding-bound), "
                                                         "demo (make run's data; use --lookahead 200), skewed "
                                                         "(a's model on small, strongly skewed tables), c (rows of dim "
                                                         "128 on tiny skewed tables)")
    parser.add_argument("--rates", default=RATES, help=f"link rates in Mbit/s, 'unshaped' for none (default {RATES})")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated modes (default all four)")
    parser.add_argument("--iterations", type=int, help="override the per-config iteration count")
    parser.add_argument("--lookahead", type=int, default=20, help="L (default 20)")
    parser.add_argument("--distance", type=int, default=2, help="P (default 2)")
    parser.add_argument("--shards", type=int, default=2, help="embedding servers, one worker each (default 2)")
    parser.add_argument("--device", default="cpu", help="the trainer's device; the servers use the CPUs")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of every point (default 3)")
    parser.add_argument("--max-transfer-s", type=float, default=300.0,
                        help="skip a rate where remote's traffic would take longer per run (default 300)")
    parser.add_argument("--work-dir", default="/tmp/dlrmflow-bench-network")
    parser.add_argument("--plot", help="the PNG to write (default WORK_DIR/network.png)")
    parser.add_argument("--json", action="store_true", help="print the tables as one JSON object instead")
    parser.add_argument("--pin", metavar="TRAINER_CPUS:SERVER_CPUS",
                        help="pin this process (the trainer, its client and scheduler; torch's threads then one per "
                             "CPU) and the embedding servers to separate CPUs, for example 1:0 (default: unpinned)")
    args = parser.parse_args()
    if args.pin:
        args.pin = parse_pin(args.pin)
        pin_process(os.getpid(), args.pin[0])
        torch.set_num_threads(len(args.pin[0]))
    rates = parse_rates(args.rates)
    modes = [m.strip() for m in args.modes.split(",")]
    if unknown := set(modes) - set(MODES):
        raise SystemExit(f"--modes: unknown {sorted(unknown)}; choose from {', '.join(MODES)}")
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else "none"
    log(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), device {args.device}, GPU {gpu}, load average {os.getloadavg()[0]:.1f}")
    rows, skipped = [], []
    try:
        for key in args.configs.split(","):
            if key.strip() not in CONFIGS:
                raise SystemExit(f"--configs: unknown {key.strip()!r}; choose from {', '.join(CONFIGS)}")
            data = prepare(key.strip(), args, work)
            more, skip = run_config(data, rates, modes, args, work)
            rows += more
            skipped += skip
    except LinkUnavailableError as exc:
        print(f"network.py: {exc}", file=sys.stderr)
        return 2
    log(f"load average at the end: {os.getloadavg()[0]:.1f}")
    points, same = compare(rows), same_state(rows)
    png = plot(rows, Path(args.plot) if args.plot else work / "network.png")
    if args.json:
        print(json.dumps({"machine": {"cpus": os.cpu_count(), "device": args.device, "gpu": gpu},
                          "runs": rows, "points": points, "skipped": skipped, "same_state": same,
                          "plot": str(png)}, indent=2, default=str))
    else:
        print_table(rows, points, skipped, same)
        print(f"plot: {png}")
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
