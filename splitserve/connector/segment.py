"""Owner-only (0600) shared-memory files in /dev/shm, mapped into this process.

D's staging area is one (P maps it too, for the shm transport); the table of complete transfers
is another (the scheduler process maps it).
"""

from __future__ import annotations

import glob
import logging
import mmap
import os
import secrets
import time

import torch

logger = logging.getLogger(__name__)
SHM_GLOB = "/dev/shm/splitserve-*"


def sweep_orphans(min_age_s: float = 60.0) -> list[str]:
    """Remove our shared-memory files that no live process maps: what a worker killed with
    SIGKILL leaves behind (SIGTERM cleans up itself). Only files this user owns, and only
    those untouched for `min_age_s`, so a segment between creation and mapping is safe."""
    mapped: set[str] = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                mapped.update(line.rsplit(" ", 1)[-1].strip() for line in f
                              if "/dev/shm/splitserve-" in line)
        except OSError:  # gone, or another user's process (which cannot map our 0600 files)
            continue
    removed = []
    now = time.time()
    for path in glob.glob(SHM_GLOB):
        try:
            st = os.stat(path)
            if st.st_uid == os.getuid() and path not in mapped and now - st.st_mtime > min_age_s:
                os.unlink(path)
                removed.append(path)
        except OSError:
            continue
    if removed:
        logger.info("removed %d orphaned shared-memory files", len(removed))
    return removed


class SharedSegment:
    """Create (`create=True`, the default when no path is given) or map an existing file."""

    def __init__(self, size: int, path: str | None = None, create: bool | None = None) -> None:
        self.owner = path is None if create is None else create
        self.path = path or f"/dev/shm/splitserve-{os.getpid()}-{secrets.token_hex(6)}"
        flags = os.O_RDWR
        if self.owner:
            flags |= os.O_CREAT | (os.O_EXCL if path is None else os.O_TRUNC)
        fd = os.open(self.path, flags, 0o600)
        try:
            if self.owner:
                os.ftruncate(fd, size)
            self.size = os.fstat(fd).st_size
            self._map = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)

    def close(self) -> None:
        del self.tensor
        try:
            self._map.close()
        except BufferError:  # a view is still alive somewhere; the OS reclaims at exit
            pass
        if self.owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
