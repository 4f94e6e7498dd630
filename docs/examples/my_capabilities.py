# docs/examples/my_capabilities.py: capabilities a connector and a sink opt into, and the owner's checks
from afd_mrv2 import ConnectorContext, InFlightSink, SupportsFailover, Work, WorkItem, hookimpl


class Record:
    count = 0  # FFN ranks failed over

    def as_dict(self) -> dict:
        return {"failovers": self.count}


class ReplicaSide:
    """The Attention side's routing: which FFN ranks it sends to (AttentionFailover's members)."""

    def __init__(self, num_ffn: int) -> None:
        self.live = frozenset(range(num_ffn))
        self.failovers = Record()

    def start_without(self, ffn: int) -> None:  # lost before the first item
        self.live -= {ffn}

    def take_back(self, ffn: int) -> None:  # back, between two steps
        self.live |= {ffn}


class MyReplicaLink(SupportsFailover):  # the base is the declaration
    hook_api_version = 2

    def __init__(self, context: ConnectorContext) -> None:
        self.role = context.typed().role
        self.side = ReplicaSide(context.config.num_ffn_ranks)

    def attention_failover(self) -> ReplicaSide | None:
        return self.side if self.role == "attention" else None

    def ffn_failover(self) -> None:
        return None  # this sketch's FFN side counts no re-sends

    @hookimpl
    def on_recv(self, work: Work) -> None: ...

    @hookimpl
    def on_compute(self, work: Work, compute) -> None: ...

    @hookimpl
    def on_send(self, work: Work) -> None: ...


class MySink(InFlightSink):  # takes a result still in flight: it calls result.wait() itself
    def __init__(self) -> None:
        self.results = {}

    def __call__(self, item: WorkItem, result) -> None:
        self.results[item] = result


if __name__ == "__main__":  # run it: python docs/examples/my_capabilities.py
    from afd_mrv2 import AttentionContext, failover_of, supports_in_flight
    from afd_mrv2.config import parse_afd_config

    config = parse_afd_config({"connector": "my_replica_link", "role": "attention", "num_ffn_ranks": 2})
    connector = MyReplicaLink(AttentionContext(config=config))
    failover = failover_of(connector)  # what an owner does at start-up; None: no failover
    assert failover is not None and failover_of(object()) is None
    failover.start_without(1)
    assert failover.live == {0}
    assert supports_in_flight(MySink()) and not supports_in_flight(lambda item, result: None)
    print(f"my_replica_link fails over (live FFN ranks {sorted(failover.live)}); MySink takes results in flight")
