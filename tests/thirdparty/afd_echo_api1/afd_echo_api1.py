"""afd-echo-api1: a third-party connector written to afd-mrv2's hook API version 1.

FROZEN: this file stands for a plugin already released by someone else.  Do not
update it when the API changes: a change that breaks it breaks every plugin
written to API 1, and must come with a new hook API version (which may refuse
it in one line) instead.

Resources: ``source(item) -> tensor`` (the inputs), ``sink(item, tensor)`` (the outputs).
Options (``connector_extra_config``): ``recv_delay_s`` / ``send_delay_s``, the wire time of a transfer.
"""

import time

import torch

from afd_mrv2 import ConnectorContext, Stream, Work, hookimpl


class EchoLink:
    hook_api_version = 1

    def __init__(self, context: ConnectorContext) -> None:
        self.source = context.resource("source")
        self.sink = context.resource("sink")
        self.recv_delay_s = float(context.config.extra.get("recv_delay_s", 0.0))
        self.send_delay_s = float(context.config.extra.get("send_delay_s", 0.002))

    @hookimpl
    def on_recv(self, work: Work, stream: Stream) -> None:
        incoming = self.source(work.item)
        if work.inputs.state is None:  # preallocate once per input slot, reuse afterwards
            work.inputs.state = torch.empty_like(incoming)
        time.sleep(self.recv_delay_s)
        work.inputs.state.copy_(incoming)

    @hookimpl
    def on_compute(self, work: Work, stream: Stream, compute) -> None:
        out = compute(work.item, work.inputs.state)
        if work.outputs.state is None:  # preallocate once per output slot
            work.outputs.state = torch.empty_like(out)
        work.outputs.state.copy_(out)
        work.transfer["rows"] = out.shape[0]

    @hookimpl
    def on_send(self, work: Work, stream: Stream) -> None:
        time.sleep(self.send_delay_s)
        assert work.transfer["rows"] == work.outputs.state.shape[0]
        self.sink(work.item, work.outputs.state.clone())

    @hookimpl
    def on_cleanup(self, work: Work, error: BaseException) -> None:
        work.transfer.clear()
