"""The connector tests' shared fixture: D's listener over a staging area, in this process."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from splitserve.connector.listener import KVListener
from splitserve.connector.staging import StagingArea
from splitserve.connector.stats import ConnectorStats
from tests.support.channels import FP, SHAPE, TOKEN


@pytest.fixture
def listener() -> Iterator[tuple[KVListener, StagingArea]]:
    staging = StagingArea(8 * 1024**2, SHAPE, lease_s=30.0, stats=ConnectorStats())
    lis = KVListener("127.0.0.1", 0, TOKEN, FP, staging, lambda q: {"echo": q.to_wire()})
    yield lis, staging
    lis.close()
    staging.close()
