"""What W data-parallel trainers send each other, over torch.distributed (gloo).

Gloo moves host memory: a trainer on a GPU hands its tensors here as they are, and this module copies them
to the host before a collective (``.cpu()``, nothing for a tensor already there); what comes back is on the
host, and the caller moves it to its device. The sums below are taken on the host, so trainers on GPUs and
on CPUs add a row's gradients in the same order, in the same precision.

A :class:`TrainerGroup` is one trainer's membership: its rank, the group size ``W``, and two
process groups: the default one, used by the training loop (dense gradients, embedding-row
gradients, barriers), and a second one used only by the oracle's prefetch thread (rows fetched
for the cache), so the two threads never interleave calls on one group.

Every sum over trainers is taken here, in rank order, on gathered values
(:func:`sum_in_rank_order`, :func:`sum_over_users`) rather than by ``all_reduce``: the order in
which an all-reduce adds its W inputs depends on the algorithm, the tensor's size and the chunk
an element falls in, and a run's modes put different rows in different tensors. Summed in rank
order, a row's gradient is the same bits in every mode, on every trainer.

Sizes. Gloo gathers equal-sized tensors; every caller here already knows how many rows each
trainer contributes (the trainers share each iteration's slices and the plan), so
:meth:`TrainerGroup.all_gather_rows` pads to the largest and cuts each part back without sending the
sizes, and :meth:`TrainerGroup.send_rows` sends each peer exactly the rows it expects. The
bytes a trainer sends to the others and receives from them are counted per kind of traffic.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import socket
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from dlrmflow.engine.errors import UserInputError

# How long a collective may wait for a peer. A peer that dies closes its sockets and the others
# fail at once; this bounds only a peer that hangs.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
# How long the trainers may take to find each other: their Dask tasks start within seconds of each other, so a
# trainer that cannot reach the others within this is misconfigured (an address or interface), not slow.
RENDEZVOUS_TIMEOUT = datetime.timedelta(seconds=60)
GLOO_INTERFACE = "GLOO_SOCKET_IFNAME"  # the interface gloo binds to: the user's setting wins


class TrainersCannotConnect(UserInputError):
    """The trainers could not connect to each other; the message names the addresses and the setting."""


def interface_of(address: str) -> str | None:
    """The network interface that holds ``address`` (an IP address or a host name) on this host, or None."""
    import psutil

    try:
        ips = {info[4][0] for info in socket.getaddrinfo(address, None)}
    except OSError:
        return None
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] in ips for a in addresses if a.family in (socket.AF_INET, socket.AF_INET6)):
            return name
    return None


@contextlib.contextmanager
def gloo_bound_to(address: str | None) -> Iterator[str | None]:
    """While gloo creates its devices: bind them to the interface of ``address`` (the host's address its Dask
    worker listens on, which the other trainers reach), unless the user set :data:`GLOO_INTERFACE`. Without
    it gloo takes the address the host name resolves to, on many hosts a loopback address the other hosts
    cannot reach. Yields the interface used (None: gloo's own choice)."""
    user = os.environ.get(GLOO_INTERFACE)
    interface = user or (interface_of(address) if address else None)
    if user or interface is None:
        yield interface
        return
    os.environ[GLOO_INTERFACE] = interface
    try:
        yield interface
    finally:
        del os.environ[GLOO_INTERFACE]


class TrainerGroup:
    """One trainer's view of the W trainers (rank ``rank`` of ``size``); see the module docstring."""

    def __init__(self, rank: int, size: int, init_method: str | None = None, *, address: str | None = None) -> None:
        """``init_method``: where the trainers meet (``tcp://HOST:PORT``, None: the default process group exists
        already); ``address``: this trainer's host address that the others can reach (its Dask worker's)."""
        self.rank, self.size = rank, size
        self.group = self.prefetch_group = None
        if size > 1:  # a trainer alone has no one to talk to: no process group
            with gloo_bound_to(address) as interface:
                try:
                    if init_method is not None:
                        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size,
                                                timeout=RENDEZVOUS_TIMEOUT)
                    # The training's collectives wait longer than the rendezvous may (a peer checkpointing).
                    self.group = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
                    self.prefetch_group = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
                except (RuntimeError, ValueError) as exc:  # torch's DistError and its subclasses included
                    self.close()
                    cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                    raise TrainersCannotConnect(
                        f"trainer {rank} of {size} could not connect to the other trainers (meeting at "
                        f"{init_method}, this trainer's address {address or 'unknown'} on interface "
                        f"{interface or 'chosen by gloo'}): {cause}; set {GLOO_INTERFACE} on every trainer's host "
                        "to the network interface the trainers' hosts reach each other on") from None
        self.bytes_sent: Counter[str] = Counter()  # kind of traffic -> bytes this trainer sent to the others
        self.bytes_received: Counter[str] = Counter()  # kind of traffic -> bytes it received from them

    @classmethod
    def alone(cls) -> TrainerGroup:
        """The group of one trainer: every collective returns this trainer's own part."""
        return cls(0, 1)

    def close(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()

    def average_dense_gradients(self, params: Sequence[torch.nn.Parameter], loss: torch.Tensor) -> torch.Tensor:
        """Every ``p.grad`` becomes the trainers' mean gradient, summed in rank order; returns the trainers'
        mean ``loss``. One flat buffer per iteration (the loss rides along); alone, nothing changes."""
        if self.size == 1:
            return loss
        flat = torch.cat([p.grad.reshape(-1) for p in params] + [loss.reshape(1)])
        mean = sum_in_rank_order(self.all_gather_equal(flat, "dense gradients")).to(flat.device)
        offset = 0
        for p in params:
            p.grad.copy_(mean[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        return mean[-1]

    def _count(self, kind: str, tensor: torch.Tensor, received: int) -> None:
        """``tensor`` went to each of the others; ``received`` bytes came from them."""
        self.bytes_sent[kind] += tensor.numel() * tensor.element_size() * (self.size - 1)
        self.bytes_received[kind] += received

    def all_gather_equal(self, tensor: torch.Tensor, kind: str) -> list[torch.Tensor]:
        """Every trainer's ``tensor`` (same shape on all), in rank order, on the host."""
        tensor = tensor.cpu()
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor, group=self.group)
        self._count(kind, tensor, tensor.numel() * tensor.element_size() * (self.size - 1))
        return parts

    def all_gather_rows(self, rows: torch.Tensor, counts: Sequence[int], kind: str, *,
                        prefetch: bool = False, async_op: bool = False):
        """Every trainer's ``[counts[w], width]`` rows, in rank order, on the host (``rows`` is this trainer's
        part).

        ``async_op``: returns a :class:`PendingGather` to :meth:`~PendingGather.wait` on instead."""
        if rows.shape[0] != counts[self.rank]:
            raise ValueError(f"trainer {self.rank} contributes {rows.shape[0]} rows, the counts say "
                             f"{counts[self.rank]}")
        rows, most = rows.cpu(), max(counts)
        if most == 0:  # every trainer knows the counts: all skip the call together
            empty = [rows.new_zeros((0, *rows.shape[1:])) for _ in range(self.size)]
            pending = PendingGather(None, empty, list(counts))
            return pending if async_op else pending.wait()
        padded = rows if rows.shape[0] == most else torch.cat(
            [rows, rows.new_zeros((most - rows.shape[0], *rows.shape[1:]))])
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        group = self.prefetch_group if prefetch else self.group
        work = dist.all_gather(parts, padded.contiguous(), group=group, async_op=async_op)
        row_bytes = math.prod(rows.shape[1:]) * rows.element_size()  # this trainer may contribute no row
        self._count(kind, rows, (sum(counts) - counts[self.rank]) * row_bytes)
        pending = PendingGather(work, parts, list(counts))
        return pending if async_op else pending.wait()

    def send_rows(self, sends: dict[int, torch.Tensor], counts: dict[int, int], width: int, kind: str, *,
                  prefetch: bool = False, tag: int = 0) -> PendingSends:
        """Point to point: ``sends[h]`` (rows ``[k, width]``) to trainer h, ``counts[u]`` rows from trainer u
        (on the host), all at once; returns a :class:`PendingSends` whose :meth:`~PendingSends.wait`
        gives the rows received, by trainer. Both sides must agree on every count (a count of 0 sends nothing); ``tag``
        keeps apart sends that may be in flight together on one process group."""
        group = self.prefetch_group if prefetch else self.group
        works, received, keep = [], {}, []
        for peer in range(self.size):
            if peer == self.rank:
                continue
            if counts.get(peer, 0):
                received[peer] = torch.empty((counts[peer], width), dtype=torch.float32)
                works.append(dist.irecv(received[peer], src=peer, group=group, tag=tag))
                self.bytes_received[kind] += received[peer].numel() * 4
            rows = sends.get(peer)
            if rows is not None and rows.shape[0]:
                keep.append(rows.cpu().contiguous())  # alive until the send completes
                works.append(dist.isend(keep[-1], dst=peer, group=group, tag=tag))
                self.bytes_sent[kind] += rows.numel() * rows.element_size()
        return PendingSends(works, received, keep)

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier(group=self.group)

    def broadcast_object(self, obj: Any) -> Any:
        """Trainer 0's ``obj`` (picklable), on every trainer."""
        if self.size == 1:
            return obj
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


class PendingSends:
    """The sends and receives of a :meth:`TrainerGroup.send_rows` in flight."""

    def __init__(self, works: list, received: dict[int, torch.Tensor], keep: list[torch.Tensor]) -> None:
        self.works, self.received, self.keep = works, received, keep

    def wait(self) -> dict[int, torch.Tensor]:
        for work in self.works:
            work.wait()
        self.works, self.keep = [], []
        return self.received


class PendingGather:
    """An :meth:`TrainerGroup.all_gather_rows` in flight."""

    def __init__(self, work, parts: list[torch.Tensor], counts: list[int]) -> None:
        self.work, self.parts, self.counts = work, parts, counts

    def wait(self) -> list[torch.Tensor]:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return [part[:n] for part, n in zip(self.parts, self.counts, strict=True)]


def sum_in_rank_order(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``((parts[0] + parts[1]) + parts[2]) + ...`` divided by their number: the trainers' mean."""
    total = parts[0].clone()
    for part in parts[1:]:
        total.add_(part)
    return total.div_(len(parts)) if len(parts) > 1 else total


def sum_over_users(ids: np.ndarray, parts: Sequence[tuple[np.ndarray, torch.Tensor]], size: int) -> torch.Tensor:
    """Per id of ``ids`` (sorted): the sum, in rank order, of the rows the trainers that have it hold
    for it (``parts[w]`` = trainer w's sorted ids and their rows), divided by ``size`` (the trainers'
    mean gradient of a row, the others contributing nothing).

    Only holders' rows are added (the first one is taken as it is): adding a non-user's zero would
    turn a gradient of -0.0 into +0.0. Every id must have at least one holder."""
    width = parts[0][1].shape[1]
    total = torch.empty((len(ids), width), dtype=parts[0][1].dtype)
    have = np.zeros(len(ids), dtype=bool)
    for part_ids, rows in parts:
        if not len(part_ids) or not len(ids):
            continue
        pos = np.searchsorted(part_ids, ids)
        found = pos < len(part_ids)
        found[found] = part_ids[pos[found]] == ids[found]
        first, more = found & ~have, found & have
        if first.any():
            total[torch.from_numpy(np.flatnonzero(first))] = rows[torch.from_numpy(pos[first])]
        if more.any():
            where = torch.from_numpy(np.flatnonzero(more))
            total[where] = total[where] + rows[torch.from_numpy(pos[more])]
        have |= found
    if not have.all():
        raise ValueError(f"id {int(ids[~have][0])} has no holder among the trainers")
    return total.div_(size) if size > 1 else total
