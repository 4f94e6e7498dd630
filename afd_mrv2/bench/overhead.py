"""Per-item executor overhead with no-op hooks, per backend and schedule.

Run: ``python -m afd_mrv2.bench.overhead [--items N] [--repeats R]``.  Prints the
median over ``repeats`` runs of (wall time / items): everything the executor does
per work item (3 hook calls through pluggy, event edges, slot bookkeeping, spans),
with a connector that does nothing but count its calls
(:class:`~afd_mrv2.bench.noop.NoopConnector`).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

from afd_mrv2.bench.noop import NoopConnector
from afd_mrv2.config import MultistreamConfig
from afd_mrv2.devices import make_backend
from afd_mrv2.items import PHASES
from afd_mrv2.pipeline import Executor, WorkItem
from afd_mrv2.plugins import plugins_for


@dataclass(frozen=True)
class Overhead:
    """One timed run: ``items`` items through the hooks in ``wall_s`` seconds."""

    backend: str
    pipelined: bool
    items: int
    calls: dict[str, int]  # phase -> hook calls the connector counted
    wall_s: float  # from the first submit until the run drained (construction and close excluded)

    @property
    def per_item_us(self) -> float:
        return self.wall_s / self.items * 1e6


def _no_compute(item: WorkItem, *payload: object) -> None:
    """The no-op connector never calls compute; the executor still needs one."""


def measure(backend: str, *, pipelined: bool, items: int = 2000, depth: int = 2) -> Overhead:
    """Time one run of ``items`` no-op items; refuses to report a run that skipped a hook call."""
    connector = NoopConnector()
    executor = Executor(
        plugins_for(connector),
        make_backend(backend),
        MultistreamConfig(enabled=pipelined, depth=depth),
        compute=_no_compute,
    )
    try:
        start = time.perf_counter()
        executor.run(WorkItem(0, 0, i) for i in range(items))
        wall_s = time.perf_counter() - start
    finally:
        executor.close()
    calls = dict(connector.calls)
    if calls != dict.fromkeys(PHASES, items):
        raise RuntimeError(f"overhead run of {items} items made hook calls {calls}: not every item ran every phase")
    return Overhead(backend, pipelined, items, calls, wall_s)


def per_item_us(backend: str, *, pipelined: bool, items: int = 2000, depth: int = 2) -> float:
    """Wall time per item, in microseconds, of one run of ``items`` no-op items."""
    return measure(backend, pipelined=pipelined, items=items, depth=depth).per_item_us


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    targets = {"recording": 30.0, "host": 160.0}
    print(f"{'backend':<10} {'schedule':<11} {'us/item (median of ' + str(args.repeats) + ')':>24} {'target':>8}")
    for backend, target in targets.items():
        for pipelined in (False, True):
            runs = [per_item_us(backend, pipelined=pipelined, items=args.items) for _ in range(args.repeats)]
            schedule = "pipelined" if pipelined else "serialized"
            print(f"{backend:<10} {schedule:<11} {statistics.median(runs):>24.1f} {target:>8.0f}")


if __name__ == "__main__":
    main()
