"""afd-echo-api0: a third-party connector written to afd-mrv2's hook API as it stood
before hook API 1 (one slot per item: ``work.slot.state``, ``work.scratch``), following
the connector guide of that time.  It declares no ``hook_api_version``.

FROZEN: this file stands for a plugin already released by someone else.  Do not
update it when the API changes; afd-mrv2 must keep serving it (or refuse it in one
line once API 0 is no longer served).

Resources: ``source(item) -> tensor`` (the inputs), ``sink(item, tensor)`` (the outputs).
Options (``connector_extra_config``): ``recv_delay_s`` / ``send_delay_s``, the wire time of a transfer.
"""

import time

import torch

from afd_mrv2 import hookimpl


class EchoLink:
    def __init__(self, context):
        self.source = context.resource("source")
        self.sink = context.resource("sink")
        self.recv_delay_s = float(context.config.extra.get("recv_delay_s", 0.0))
        self.send_delay_s = float(context.config.extra.get("send_delay_s", 0.002))

    @hookimpl
    def on_recv(self, work, stream):
        incoming = self.source(work.item)
        if work.slot.state is None:  # preallocate once per slot, reuse afterwards
            work.slot.state = {"recv": torch.empty_like(incoming), "send": torch.empty_like(incoming)}
        time.sleep(self.recv_delay_s)
        work.slot.state["recv"].copy_(incoming)

    @hookimpl
    def on_compute(self, work, compute):
        out = compute(work.item, work.slot.state["recv"])
        work.slot.state["send"].copy_(out)  # the send buffer lives in the slot until the slot's next recv
        work.scratch["rows"] = out.shape[0]

    @hookimpl
    def on_send(self, work):
        time.sleep(self.send_delay_s)
        assert work.scratch["rows"] == work.slot.state["send"].shape[0]
        self.sink(work.item, work.slot.state["send"].clone())

    @hookimpl
    def on_cleanup(self, work, error):
        pass
