"""The lanes group (migrations/sources/03_lanes.sql): fleet.sync_lane never changes a lane under a claim
in flight, and the next claim sees what it wrote. (What sync_lane answers, created / unchanged /
updated, through the store: tests/test_store.py; pools and profiles through real shifts:
tests/test_dispatch.py.)
"""

from __future__ import annotations

import pytest
from psycopg import errors
from sqlkit import (
    Call,
    add_lane,
    fill,
    leases,
    one,
    open_session,
    running,
    wait_until_waiting,
)

# ------------------------------------------------------------------------------------------------
# sync_lane and the claims in flight


def test_sync_lane_waits_for_the_claims_in_flight_and_the_next_claim_sees_its_limit(connect) -> None:
    setup = connect()
    add_lane(setup, "free")
    add_lane(setup, "other")
    fill(setup, "free", 6)
    fill(setup, "other", 1)
    sa, sb, so = open_session(setup, "free", host="host-1"), open_session(setup, "free", host="host-2"), open_session(setup, "other", host="host-3")

    # an unlimited claim in flight; the lane is given max_running 3 meanwhile
    a = connect(autocommit=False)
    assert len(leases(a, sa, 3)) == 3
    s = connect()
    sync = Call(s, lambda c: one(c, "select fleet.sync_lane('free', '{\"max_running\": 3}')"))
    sync.start()
    assert wait_until_waiting(setup, s.info.backend_pid) == "advisory"
    a.commit()
    assert sync.outcome() == "updated"
    # had the sync not waited, this claim would not see the three above (uncommitted) and take 3 more
    b = connect()
    assert leases(b, sb, 3) == []
    assert running(setup, "free") == 3

    # a sync not yet committed holds back the claims of its lane only
    s2 = connect(autocommit=False)
    assert one(s2, "select fleet.sync_lane('free', '{\"max_running\": 4}')") == "updated"
    b.execute("set lock_timeout = '300ms'")
    with pytest.raises(errors.LockNotAvailable):
        leases(b, sb, 1)
    o = connect()
    o.execute("set lock_timeout = '2s'")
    assert len(leases(o, so, 1)) == 1
    s2.commit()
    assert len(leases(b, sb, 3)) == 1  # the new limit: 4
