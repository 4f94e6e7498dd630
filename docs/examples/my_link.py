# docs/examples/my_link.py: a connector written to hook API 2, run end to end through the executor
import time

import torch

from afd_mrv2 import HOOK_API_VERSION, ConnectorContext, Stream, Work, hookimpl


class MyLink:
    hook_api_version = 2  # the hook API this connector is written for (afd_mrv2.HOOK_API_VERSION)

    def __init__(self, context: ConnectorContext) -> None:
        context = context.typed()  # AttentionContext or FfnContext: the owner's runtime objects, one field each
        self.options = context.config.extra  # afd.connector_extra_config (parse it: docs/config.md)
        self.source = context.need(context.source, "source")  # a clear error when the owner left it out
        self.sink = context.need(context.sink, "sink")

    @hookimpl
    def on_recv(self, work: Work, stream: Stream) -> None:
        incoming = self.source(work.item)  # a real link receives here, polling work.cancelled
        if work.inputs.state is None:  # preallocate once per input slot, reuse afterwards
            work.inputs.state = torch.empty_like(incoming)
        work.inputs.state.copy_(incoming)

    @hookimpl
    def on_compute(self, work: Work, stream: Stream, compute) -> None:
        result = compute(work.item, work.inputs.state)  # the input slot is free once this returns
        if work.outputs.state is None:  # preallocate once per output slot
            work.outputs.state = torch.empty_like(result)
        work.outputs.state.copy_(result)
        work.transfer["sent_at"] = None  # per-item state from recv to send lives in work.transfer

    @hookimpl
    def on_send(self, work: Work, stream: Stream) -> None:
        time.sleep(0.001)  # the wire: complete the transfer before returning
        work.transfer["sent_at"] = time.monotonic()
        self.sink(work.item, work.outputs.state.clone())

    @hookimpl
    def on_cleanup(self, work: Work, error: BaseException) -> None:
        work.transfer.clear()  # cancel what is pending for work.item


if __name__ == "__main__":  # run it: python docs/examples/my_link.py
    from afd_mrv2 import FfnContext, WorkItem
    from afd_mrv2.config import parse_afd_config
    from afd_mrv2.devices import HostBackend
    from afd_mrv2.pipeline import Executor
    from afd_mrv2.plugins import plugins_for

    config = parse_afd_config(
        {"connector": "my_link", "role": "ffn", "multistream": {"enabled": True, "depth": 2, "backend": "host"}}
    )
    received = {}
    context = FfnContext(
        config=config,
        source=lambda item: torch.full((4, 8), float(item.seq)),
        sink=lambda item, t: received.update({item: t}),
    )
    executor = Executor(
        plugins_for(MyLink(context), name="my_link"),
        HostBackend(),
        config.multistream,
        compute=lambda item, x: x * 2,
        role="ffn",
    )
    items = [WorkItem(layer_idx=0, stage_idx=0, seq=s) for s in range(16)]
    with executor:
        executor.run(items)
    assert all(torch.equal(received[i], torch.full((4, 8), 2.0 * i.seq)) for i in items)
    print(f"my_link (hook API {HOOK_API_VERSION}): {len(received)} items through the pipelined executor, all exact")
