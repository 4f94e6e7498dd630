"""Which bytes of a safetensors checkpoint sit in the page cache (Linux): what a loader has read.

Drop a file's cached pages (:func:`drop_page_cache`), let a process load it, then ask which of
its pages are resident (:func:`resident_pages`, libc ``mincore`` on a read-only mapping) and how
many whole pages inside each tensor's byte range (:func:`tensor_ranges`) are among them
(:func:`range_residency`).  Only pages wholly inside a range count, so a page shared with a
neighbouring tensor, read for that neighbour, does not.  A tmpfs file never drops its pages.
See docs/internals/reference.md, "afd_mrv2.checkpoints".
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from afd_mrv2.architectures import routed_expert_id
from afd_mrv2.errors import ConfigError

__all__ = [
    "PAGE",
    "checkpoint_residency",
    "drop_page_cache",
    "file_residency",
    "range_residency",
    "resident_pages",
    "tensor_ranges",
]

PAGE = mmap.PAGESIZE


def tensor_ranges(path: str | Path) -> dict[str, tuple[int, int]]:
    """Each tensor's absolute byte range ``[start, end)`` in safetensors file ``path``, from its header
    (read with readahead off: no page wholly inside a tensor comes into the page cache with it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        raw = os.pread(fd, 8, 0)
        length = int.from_bytes(raw, "little")
        text = os.pread(fd, length, 8) if len(raw) == 8 else b""
    finally:
        os.close(fd)
    if len(raw) != 8 or len(text) != length:
        raise ConfigError(str(path), "not a safetensors file (its header is cut short)")
    header: dict[str, Any] = json.loads(text)
    out = {}
    for name, meta in header.items():
        if name != "__metadata__":
            begin, end = meta["data_offsets"]
            out[name] = (8 + length + int(begin), 8 + length + int(end))
    return out


def drop_page_cache(path: str | Path) -> None:
    """Write back, then drop, ``path``'s pages from the page cache (``POSIX_FADV_DONTNEED``)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


def resident_pages(path: str | Path) -> list[bool]:
    """For each page of ``path``, whether it is in the page cache (reading nothing of the file)."""
    size = os.path.getsize(path)
    if size == 0:
        return []
    libc = _libc()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    finally:
        os.close(fd)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise ConfigError(str(path), f"mmap failed: {os.strerror(ctypes.get_errno())}")
    try:
        vec = (ctypes.c_ubyte * ((size + PAGE - 1) // PAGE))()
        if libc.mincore(addr, size, vec) != 0:
            raise ConfigError(str(path), f"mincore failed: {os.strerror(ctypes.get_errno())}")
    finally:
        libc.munmap(addr, size)
    return [bool(v & 1) for v in vec]


def range_residency(path: str | Path, ranges: Mapping[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """``{name: (resident pages, pages)}`` over the whole pages inside each byte range of ``path``."""
    pages = resident_pages(path)
    out = {}
    for name, (begin, end) in ranges.items():
        first, last = -(-begin // PAGE), end // PAGE
        inside = pages[first:last] if last > first else []
        out[name] = (sum(inside), len(inside))
    return out


def file_residency(path: str | Path) -> float:
    """The fraction of ``path``'s pages in the page cache (0.0 for an empty file)."""
    pages = resident_pages(path)
    return sum(pages) / len(pages) if pages else 0.0


def checkpoint_residency(folder: str | Path) -> dict[str, tuple[int, int]]:
    """Over a folder's ``*.safetensors``: ``(resident pages, pages)`` inside routed-expert tensors
    (``"routed_experts"``) and inside all other tensors (``"other"``)."""
    totals = {"routed_experts": [0, 0], "other": [0, 0]}
    for path in sorted(Path(folder).glob("*.safetensors")):
        for name, (resident, pages) in range_residency(path, tensor_ranges(path)).items():
            total = totals["routed_experts" if routed_expert_id(name) is not None else "other"]
            total[0] += resident
            total[1] += pages
    return {kind: (r, n) for kind, (r, n) in totals.items()}
