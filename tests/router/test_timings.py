"""`Timings.as_dict`: the spans it reports, and the ones it sets against D's transfer record."""

from __future__ import annotations

from splitserve.common.vocab import TransferStatus
from splitserve.common.wire import SideRecord
from splitserve.router.timings import Timings


def timed(d_sent_wall: float | None) -> Timings:
    t = Timings(received=10.0, p_sent=10.0, p_sent_wall=1000.0, t1_back=10.1, first_sent=10.101,
                d_sent=10.102, d_sent_wall=d_sent_wall, d_first=10.13, t2_sent=10.131,
                end=10.5)
    t.kv = SideRecord("t", "recv", TransferStatus.LOADED, first_byte_s=1000.01,
                      scheduled_s=1000.111)
    return t


def test_the_decode_wait_is_d_scheduling_the_leg_against_its_sending() -> None:
    out = timed(1000.102).as_dict()
    assert out["d_queue_s"] == 0.028 and out["handover_s"] == 0.03
    assert out["d_wait_s"] == 0.009 and out["p_queue_s"] == 0.01


def test_a_leg_that_loaded_no_kv_has_no_decode_wait() -> None:
    # a resumed leg recomputes: D's record is the first leg's, not this one's
    assert "d_wait_s" not in timed(None).as_dict()
    t = timed(1000.102)
    t.kv = SideRecord("t", "recv", TransferStatus.FAILED, cause="load_timeout")
    assert "d_wait_s" not in t.as_dict()
