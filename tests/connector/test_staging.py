"""StagingArea: reservation, refusal, lease expiry and the writer/reader freeing contract."""

from __future__ import annotations

import os
import time

import pytest
import torch

from splitserve.connector.layout.staging_format import KVShape
from splitserve.connector.segment import SharedSegment, sweep_orphans
from splitserve.connector.staging import RegionAllocator, StagingArea, StagingRefused
from splitserve.connector.stats import ConnectorStats

SHAPE = KVShape(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float32)  # 1 KiB/token


@pytest.fixture
def area() -> StagingArea:
    a = StagingArea(1024**2, SHAPE, lease_s=10.0, stats=ConnectorStats())
    yield a
    a.close()


def test_segment_is_owner_only(area: StagingArea) -> None:
    assert os.stat(area.segment.path).st_mode & 0o777 == 0o600


def test_allocator_merges_free_ranges() -> None:
    alloc = RegionAllocator(16 * 4096)
    a, b, c = alloc.alloc(4096), alloc.alloc(5000), alloc.alloc(4096)
    assert (a, b, c) == (0, 4096, 3 * 4096)
    alloc.free(b, 5000)
    alloc.free(a, 4096)
    assert alloc.alloc(3 * 4096) == 0  # a and b merged into one range
    alloc.free(0, 3 * 4096)
    alloc.free(c, 4096)
    assert alloc.free_bytes == 16 * 4096


def test_full_staging_refuses_and_remembers(area: StagingArea) -> None:
    with pytest.raises(StagingRefused, match="staging_full"):
        area.begin("huge", 2000)  # 2 MB > 1 MiB
    assert area.final_status("huge") == "refused"
    area.begin("ok", 100)
    with pytest.raises(StagingRefused, match="duplicate_transfer_id"):
        area.begin("ok", 100)


def test_region_freed_only_when_writer_and_reader_are_done(area: StagingArea) -> None:
    st = area.begin("t", 100)
    for layer in range(2):
        st.chunks[0] = 100
        area.layer_received(st, layer, 100)
    assert area.end(st)
    assert area.claim("t") is st
    area.release(st, "loaded")  # reader done, writer not yet: still reserved
    assert area.state()["staged_bytes"] > 0
    area.writer_done(st)
    assert area.state()["staged_bytes"] == 0
    area.check_integrity()


def test_reaper_frees_every_expired_lease_not_just_the_oldest(area: StagingArea) -> None:
    first = area.begin("a", 10)
    area.begin("b", 10)
    third = area.begin("c", 10)
    area.claim("b")  # claimed by a decode request: never reaped
    first.lease_deadline = third.lease_deadline = 0.0
    for st in (first, third):
        area.writer_done(st)
    assert sorted(area.reap()) == ["a", "c"]
    assert area.state()["open_leases"] == 0 and area.state()["claimed_transfers"] == 1
    assert area.final_status("a") == "expired"


def test_the_lease_bounds_kv_complete_and_unclaimed_from_its_end() -> None:
    """A transfer still being written is never reaped, however long its prefill (over shm its
    layers are only announced at END); KV complete and unclaimed is held a whole lease after
    its END, then reaped."""
    area = StagingArea(1024**2, SHAPE, lease_s=0.2, stats=ConnectorStats())
    st = area.begin("slow", 100)
    st.chunks[0] = 100
    time.sleep(0.3)  # past BEGIN + lease: the writer is still at it
    assert area.reap() == []
    for layer in range(2):
        area.layer_received(st, layer, 100)
    assert area.end(st)
    area.writer_done(st)
    assert area.reap() == []
    time.sleep(0.3)
    assert area.reap() == ["slow"]
    assert area.final_status("slow") == "expired"
    assert area.state()["staged_bytes"] == 0
    area.close()


def test_short_transfer_fails(area: StagingArea) -> None:
    st = area.begin("short", 100)
    st.chunks[0] = 100
    area.layer_received(st, 0, 100)  # layer 1 never arrives
    assert not area.end(st)
    assert st.failed == "short_transfer"
    area.writer_done(st)
    assert area.state()["staged_bytes"] == 0  # unclaimed failure: freed at once


def test_done_table_tracks_complete_transfers(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from splitserve.connector.donetable import DoneTable

    done = DoneTable(str(tmp_path / "done"), create=True)
    reader = DoneTable.open_existing(str(tmp_path / "done"))
    assert reader is not None
    area = StagingArea(1024**2, SHAPE, lease_s=10.0, stats=ConnectorStats(), done=done)
    st = area.begin("t", 10)
    st.chunks[0] = 10
    for layer in range(2):
        area.layer_received(st, layer, 10)
    assert not reader.contains("t")
    assert area.end(st) and reader.contains("t")  # seen from another mapping
    area.release(area.claim("t"), "loaded")  # type: ignore[arg-type]
    assert not reader.contains("t")
    area.close()
    assert not os.path.exists(tmp_path / "done")


def test_discard_frees_now_or_refuses_the_push(area: StagingArea) -> None:
    st = area.begin("ended-at-t1", 10)
    area.writer_done(st)
    assert area.discard("ended-at-t1") and area.state()["staged_bytes"] == 0
    assert not area.discard("client-left-early")  # its push has not begun yet ...
    with pytest.raises(StagingRefused):  # ... and now never will
        area.begin("client-left-early", 10)
    claimed = area.begin("in-use", 10)
    area.claim("in-use")
    assert area.discard("in-use") and area.state()["claimed_transfers"] == 1  # owner keeps it
    area.release(claimed, "loaded")


def test_sweep_removes_only_unmapped_stale_files() -> None:
    """What a SIGKILLed worker leaves in /dev/shm goes; live and fresh segments stay."""
    live = SharedSegment(4096)  # mapped by this process
    orphan = SharedSegment(4096)
    orphan_path = orphan.path
    orphan.owner = False  # leave the file behind, as a killed process would
    orphan.close()
    fresh = SharedSegment(4096)
    fresh_path = fresh.path
    fresh.owner = False
    fresh.close()
    old = time.time() - 3600
    for path in (live.path, orphan_path):
        os.utime(path, (old, old))
    try:
        removed = sweep_orphans(min_age_s=60.0)
        assert orphan_path in removed and not os.path.exists(orphan_path)
        assert os.path.exists(live.path) and os.path.exists(fresh_path)  # mapped; too young
    finally:
        live.close()
        os.unlink(fresh_path)
