"""Trainers find each other on the address their Dask worker listens on, and say so in one line when they cannot."""

from __future__ import annotations

import os
import socket
import time

import pytest

from dlrmflow.engine.training import collectives
from dlrmflow.engine.training.collectives import GLOO_INTERFACE, TrainerGroup, TrainersCannotConnect, gloo_bound_to


def test_the_loopback_address_is_on_the_loopback_interface():
    assert collectives.interface_of("127.0.0.1") == "lo"
    assert collectives.interface_of("localhost") == "lo"
    assert collectives.interface_of("192.0.2.1") is None  # TEST-NET: on no interface of this host
    assert collectives.interface_of("no-such-host.invalid") is None


def test_gloo_binds_to_the_workers_interface_unless_the_user_chose_one(monkeypatch):
    monkeypatch.delenv(GLOO_INTERFACE, raising=False)
    with gloo_bound_to("127.0.0.1") as interface:
        assert interface == "lo" and os.environ[GLOO_INTERFACE] == "lo"
    assert GLOO_INTERFACE not in os.environ
    monkeypatch.setenv(GLOO_INTERFACE, "eth7")
    with gloo_bound_to("127.0.0.1") as interface:
        assert interface == "eth7" and os.environ[GLOO_INTERFACE] == "eth7"
    assert os.environ[GLOO_INTERFACE] == "eth7"


def test_a_trainer_that_cannot_reach_the_others_fails_in_one_line(monkeypatch):
    """Nobody listens at the meeting point: the trainer gives up after the rendezvous timeout, not the
    collectives' ten minutes, naming the addresses and the setting to change."""
    import datetime

    monkeypatch.setattr(collectives, "RENDEZVOUS_TIMEOUT", datetime.timedelta(seconds=2))
    monkeypatch.delenv(GLOO_INTERFACE, raising=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again below: nothing listens there
    start = time.monotonic()
    with pytest.raises(TrainersCannotConnect) as failure:
        TrainerGroup(1, 2, f"tcp://127.0.0.1:{port}", address="127.0.0.1")
    assert time.monotonic() - start < 30
    message = str(failure.value)
    assert "\n" not in message
    assert f"tcp://127.0.0.1:{port}" in message and "127.0.0.1 on interface lo" in message
    assert GLOO_INTERFACE in message
    assert GLOO_INTERFACE not in os.environ
