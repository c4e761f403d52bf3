"""Leader election with the official client's LeaseLock against the emulator: never two leaders."""

from __future__ import annotations

import threading
import time

import pytest
from kubernetes import client
from kubernetes.leaderelection import electionconfig, leaderelection
from kubernetes.leaderelection.resourcelock.leaselock import LeaseLock

from tenplex.k8s import crd
from tenplex.testing.k8s.cluster import TestCluster


@pytest.mark.slow
def test_two_schedulers_take_turns_on_the_lease(api: TestCluster) -> None:
    # LeaseLock builds its client from the default configuration.
    api.create_namespace("tenplex")
    previous = client.Configuration.get_default_copy()
    client.Configuration.set_default(api.client_configuration())
    events: list[tuple[float, str, str]] = []
    a_leads = threading.Event()

    def candidate(identity: str, hold: float) -> threading.Thread:
        def started() -> None:
            events.append((time.monotonic(), identity, "start"))
            if identity == "a":
                a_leads.set()
            time.sleep(hold)
            raise RuntimeError(f"{identity} steps down")  # stops renewing: the lease runs out

        def stopped() -> None:
            events.append((time.monotonic(), identity, "stop"))

        config = electionconfig.Config(LeaseLock(crd.LEADER_LEASE, "tenplex", identity), lease_duration=3,
                                       renew_deadline=2, retry_period=1, onstarted_leading=started,
                                       onstopped_leading=stopped)
        thread = threading.Thread(target=leaderelection.LeaderElection(config).run, daemon=True)
        thread.start()
        return thread

    try:
        a = candidate("a", hold=1.5)
        assert a_leads.wait(10), "candidate a never became leader"
        b = candidate("b", hold=0.0)
        a.join(15)
        b.join(15)
    finally:
        client.Configuration.set_default(previous)

    order = [(who, what) for _, who, what in sorted(events)]
    assert order == [("a", "start"), ("a", "stop"), ("b", "start"), ("b", "stop")]
    a_stop = next(t for t, who, what in events if (who, what) == ("a", "stop"))
    b_start = next(t for t, who, what in events if (who, what) == ("b", "start"))
    assert b_start - a_stop >= 1.0, "b must wait for a's lease to expire"
    lease = api.get("leases", crd.LEADER_LEASE, "tenplex")
    assert lease["spec"]["holderIdentity"] == "b"
