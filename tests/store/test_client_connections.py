"""Kept-alive connections the server has closed are replaced, not reported as a dead store."""

from __future__ import annotations

import socket

import pytest

from tenplex.store import client as client_module
from tenplex.store.client import StoreClient
from tests.store.conftest import TOKEN


def test_a_connection_closed_while_idle_is_replaced_without_using_a_retry(server):
    with StoreClient(server.url, TOKEN, retries=0) as c:
        assert isinstance(c.jobs(), list)
        [(conn, _since)] = c._idle
        conn.sock.shutdown(socket.SHUT_RDWR)  # what a server's keep-alive timeout does to an idle connection
        assert isinstance(c.jobs(), list)  # retries=0: only the stale-connection path can have made this work
        assert c._idle and c._idle[0][0] is not conn


def test_old_idle_connections_are_not_reused(server, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(client_module, "IDLE_REUSE_S", 0.0)
    with StoreClient(server.url, TOKEN, retries=0) as c:
        assert isinstance(c.jobs(), list)
        [(first, _since)] = c._idle
        assert isinstance(c.jobs(), list)
        [(second, _since)] = c._idle
        assert second is not first and first.sock is None  # the old one was closed, a new one made
