"""Buffer bytes held per rank, measured from the tensors the buffer slots actually hold.

The connector owns each slot's ``state`` (preallocated receive or send buffers).
What counts is what the tensors in it occupy: the bytes of their *storages*,
each storage counted once (a view into a larger buffer counts the buffer, two
views of one buffer count it once), not a declared size.  The walk follows
tensors, dataclasses, mappings, sequences and plain objects' attributes, and
never the same object twice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from afd_mrv2.work import BufferSlot


@dataclass(frozen=True)
class BufferBytes:
    """Storage bytes of the input and output slots (each slot's buffers, per slot)."""

    inputs: tuple[int, ...]
    outputs: tuple[int, ...]

    @property
    def total(self) -> int:
        return sum(self.inputs) + sum(self.outputs)

    @property
    def per_input(self) -> int:
        """The largest input slot (a slot's size once the connector allocated it)."""
        return max(self.inputs, default=0)

    @property
    def per_output(self) -> int:
        return max(self.outputs, default=0)

    def as_dict(self) -> dict[str, Any]:
        return {
            "total": self.total,
            "inputs": list(self.inputs),
            "outputs": list(self.outputs),
            "input_slots": len(self.inputs),
            "output_slots": len(self.outputs),
        }


def measure_slots(inputs: Iterable[BufferSlot], outputs: Iterable[BufferSlot]) -> BufferBytes:
    """Bytes held by each slot's state; storages shared between slots count in the first."""
    seen: set[tuple[str, int]] = set()
    return BufferBytes(
        inputs=tuple(storage_bytes(s.state, seen) for s in inputs),
        outputs=tuple(storage_bytes(s.state, seen) for s in outputs),
    )


def storage_bytes(root: object, seen: set[tuple[str, int]] | None = None) -> int:
    """Bytes of every distinct tensor storage reachable from ``root``."""
    seen = set() if seen is None else seen
    visited: set[int] = set()
    total = 0
    stack: list[object] = [root]
    while stack:
        obj = stack.pop()
        if obj is None or isinstance(obj, (str, bytes, int, float, bool)) or id(obj) in visited:
            continue
        visited.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            key = (str(obj.device), storage.data_ptr())
            if storage.nbytes() and key not in seen:
                seen.add(key)
                total += storage.nbytes()
        elif isinstance(obj, Mapping):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            stack.extend(getattr(obj, f.name) for f in dataclasses.fields(obj))
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            stack.extend(vars(obj).values())
    return total
