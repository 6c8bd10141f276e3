"""Owner-only (0600) shared-memory files in /dev/shm, mapped into this process.

D's staging area is one (P maps it too, for the shm transport); the table of complete transfers
is another (the scheduler process maps it).
"""

from __future__ import annotations

import mmap
import os
import secrets

import torch


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
