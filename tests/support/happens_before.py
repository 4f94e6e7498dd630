"""Happens-before checker over a recording-backend op log.

The log is replayed with device-stream semantics and every op gets a vector
clock (one component per stream, one for the host):

* ops on one stream are ordered (FIFO; a stream runs one op at a time);
* a ``wait`` is ordered after the ``record`` it is bound to;
* a host ``sync`` is ordered after its bound ``record``, and every op the host
  issues afterwards is ordered after the ``sync``.

``a`` happens before ``b`` iff ``clock(a)[stream(a)] <= clock(b)[stream(a)]``.
For two submitted work units that means "``a`` has finished before ``b`` starts",
on any device that honours stream and event semantics, however the streams are
interleaved at run time.

The checker proves the executor's three edges for every work item ``k``:

1. compute of ``k`` never starts before recv of ``k`` completed;
2. send of ``k`` never starts before compute of ``k`` completed;
3. input reuse: the next recv bound to ``k``'s input slot never starts before
   compute of ``k`` completed (it still reads the inputs until then);
4. output reuse: the next compute bound to ``k``'s output slot never starts
   before send of ``k`` completed (it still reads the outputs until then);

and that each phase keeps the issue order of work items.  ``host_edges=False``
ignores host syncs, proving that the device edges alone suffice (correctness
does not depend on the host waiting).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from afd_mrv2.devices.recording import Op


@dataclass(frozen=True)
class OrderingViolation:
    rule: str
    message: str


class HappensBeforeError(AssertionError):
    """The op log does not guarantee one of the executor's ordering rules."""

    def __init__(self, violations: list[OrderingViolation]) -> None:
        shown = "\n".join(f"  [{v.rule}] {v.message}" for v in violations[:10])
        more = f"\n  ... and {len(violations) - 10} more" if len(violations) > 10 else ""
        super().__init__(f"{len(violations)} happens-before violation(s):\n{shown}{more}")
        self.violations = violations


class _Clocks:
    """Vector clocks of every op in a log."""

    def __init__(self, log: Sequence[Op], *, host_edges: bool) -> None:
        streams = sorted({op.stream for op in log if op.stream is not None})
        self.index = {name: i for i, name in enumerate(streams)}
        width = len(streams)
        zero = (0,) * width
        host = zero
        last = {name: zero for name in streams}
        self.clocks: list[tuple[int, ...]] = []
        for op in log:
            if op.kind == "sync":
                if host_edges and op.bound is not None:
                    host = _join(host, self.clocks[op.bound])
                self.clocks.append(host)
                continue
            clock = _join(last[op.stream], host)
            if op.kind == "wait" and op.bound is not None:
                clock = _join(clock, self.clocks[op.bound])
            i = self.index[op.stream]
            clock = (*clock[:i], clock[i] + 1, *clock[i + 1 :])
            last[op.stream] = clock
            self.clocks.append(clock)

    def before(self, log: Sequence[Op], a: int, b: int) -> bool:
        i = self.index[log[a].stream]
        return self.clocks[a][i] <= self.clocks[b][i]


def _join(x: tuple[int, ...], y: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(max(p, q) for p, q in zip(x, y, strict=False))


def _phases(log: Sequence[Op]) -> tuple[dict[tuple, dict[str, int]], list[tuple]]:
    """Each work item's (item, slots) key -> {phase: index of its submit}, and the keys in issue order."""
    phases: dict[tuple, dict[str, int]] = {}
    issue_order: list[tuple] = []
    for i, op in enumerate(log):
        if op.kind != "submit" or op.name not in ("recv", "compute", "send"):
            continue
        key = (op.item, op.slots)
        if key not in phases:
            phases[key] = {}
            issue_order.append(key)
        phases[key][op.name] = i
    return phases, issue_order


class _Rules:
    """The executor's ordering rules checked against one log's clocks; ``violations`` collects the failures."""

    def __init__(self, log: Sequence[Op], *, host_edges: bool) -> None:
        self.log = log
        self.clocks = _Clocks(log, host_edges=host_edges)
        self.phases, self.issue_order = _phases(log)
        self.violations: list[OrderingViolation] = []

    def require(self, rule: str, a: int | None, b: int | None, message: str) -> None:
        if a is not None and b is not None and not self.clocks.before(self.log, a, b):
            self.violations.append(OrderingViolation(rule, message))

    def item_edges(self) -> None:
        """recv -> compute -> send of every work item."""
        for key in self.issue_order:
            item, _slots = key
            p = self.phases[key]
            self.require(
                "recv->compute",
                p.get("recv"),
                p.get("compute"),
                f"compute of ({item}) may start before its recv completed",
            )
            self.require(
                "compute->send",
                p.get("compute"),
                p.get("send"),
                f"send of ({item}) may start before its compute completed",
            )

    def slot_reuse(self, rule: str, which: int, releases: str, overwrites: str) -> None:
        """The next user of a slot (``which``: 0 input, 1 output) overwrites it (its ``overwrites`` phase) only
        after the previous user's ``releases`` phase completed."""
        last_user: dict[int, tuple] = {}
        for key in self.issue_order:
            slots = key[1]
            if slots is None:
                continue
            previous = last_user.get(slots[which])
            if previous is not None:
                self.require(
                    rule,
                    self.phases[previous].get(releases),
                    self.phases[key].get(overwrites),
                    f"{overwrites} of ({key[0]}) may overwrite {('input', 'output')[which]} slot {slots[which]} "
                    f"before {releases} of ({previous[0]}) completed",
                )
            last_user[slots[which]] = key

    def phase_order(self, phase: str) -> None:
        """Each phase keeps the issue order of work items."""
        ordered = [self.phases[key][phase] for key in self.issue_order if phase in self.phases[key]]
        for a, b in itertools.pairwise(ordered):
            self.require(
                "phase-order",
                a,
                b,
                f"{phase} of ({self.log[b].item}) may start before {phase} of ({self.log[a].item}) completed",
            )


def find_violations(log: Sequence[Op], *, host_edges: bool = True) -> list[OrderingViolation]:
    """Every executor ordering rule the log fails to guarantee (empty: all proven)."""
    rules = _Rules(log, host_edges=host_edges)
    rules.item_edges()
    # (rule, which slot of the pair, the previous user's releasing phase, the next user's overwriting phase)
    rules.slot_reuse("input-reuse", 0, "compute", "recv")
    rules.slot_reuse("output-reuse", 1, "send", "compute")
    for phase in ("recv", "compute", "send"):
        rules.phase_order(phase)
    return rules.violations


def check_happens_before(log: Sequence[Op], *, host_edges: bool = True) -> None:
    """Raise :class:`HappensBeforeError` unless every rule is guaranteed by the log."""
    violations = find_violations(log, host_edges=host_edges)
    if violations:
        raise HappensBeforeError(violations)
