"""Per-item executor overhead with no-op hooks, per backend and schedule.

Run: ``python -m afd_mrv2.bench.overhead [--items N] [--repeats R]``.  Prints the
median over ``repeats`` runs of (wall time / items): everything the executor does
per work item (3 hook calls through pluggy, event edges, slot bookkeeping, spans),
with connectors that do nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time

from afd_mrv2.config import MultistreamConfig
from afd_mrv2.devices import make_backend
from afd_mrv2.hookspecs import hookimpl
from afd_mrv2.pipeline import Executor, Work, WorkItem
from afd_mrv2.plugins import plugins_for


class NoopConnector:
    @hookimpl
    def on_recv(self, work: Work) -> None:
        pass

    @hookimpl
    def on_compute(self, work: Work) -> None:
        pass

    @hookimpl
    def on_send(self, work: Work) -> None:
        pass


def per_item_us(backend: str, *, pipelined: bool, items: int = 2000, depth: int = 2) -> float:
    """Wall time per item, in microseconds, of one run of ``items`` no-op items."""
    executor = Executor(
        plugins_for(NoopConnector()),
        make_backend(backend),
        MultistreamConfig(enabled=pipelined, depth=depth),
        compute=None,
    )
    try:
        start = time.perf_counter()
        executor.run(WorkItem(0, 0, i) for i in range(items))
        return (time.perf_counter() - start) / items * 1e6
    finally:
        executor.close()


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
