"""TEST ONLY: a third-party ``afd_mrv2`` connector that drops one MoE layer's routed-experts result.

Not part of afd-mrv2 and never in its entry points.  tests/vllm/test_negative_control.py
copies this file into a temporary site folder next to an
``afd_mrv2_test_drop-0.0.0.dist-info`` whose ``entry_points.txt`` declares::

    [afd_mrv2]
    drop_layer = afd_mrv2_test_drop:DropLayerConnector

puts that folder on the ``PYTHONPATH`` of ``afd-mrv2 serve`` (its roles inherit
it) and serves with ``--connector drop_layer``: the path any third-party
connector takes.

``DropLayerConnector`` is torch_p2p in every respect (the same messages, the
same FFN side, every item still makes its full round trip) except one: on the
round-trip Attention side (the owner provides ``source``/``sink``) the combined
result of MoE layer ordinal :data:`DROP_LAYER` is replaced by zeros before it
reaches the ``sink``, so the model continues that layer as if its routed
experts had given nothing.  It says so on stdout (the roles' output lands in
serve's log): one ``loaded`` line per connector and one line per dropped item
with the running count.
"""

from __future__ import annotations

from typing import Any

import torch

from afd_mrv2.hooks.p2p.torch_p2p import TorchP2pConnector
from afd_mrv2.items import WorkItem
from afd_mrv2.plugins import ConnectorContext

DROP_LAYER = 1  # the second MoE layer (ordinal among the model's MoE layers)
MARK = "afd_mrv2_test_drop:"


class DropLayerConnector(TorchP2pConnector):
    """torch_p2p whose Attention side delivers zeros for MoE layer :data:`DROP_LAYER`."""

    def __init__(self, context: ConnectorContext) -> None:
        self.drops = 0
        resources = dict(context.resources)
        dropping = "sink" in resources
        if dropping:
            resources["sink"] = self._dropping(resources["sink"])
        super().__init__(ConnectorContext(config=context.config, resources=resources))
        what = f"drops MoE layer {DROP_LAYER}" if dropping else "unchanged torch_p2p"
        print(f"{MARK} loaded on the {context.config.role} role: {what}", flush=True)

    def _dropping(self, sink: Any) -> Any:
        def sink_dropping(item: WorkItem, result: torch.Tensor) -> None:
            if item.layer_idx == DROP_LAYER:
                self.drops += 1
                print(f"{MARK} dropped {item} tokens={result.shape[0]} drops={self.drops}", flush=True)
                result = torch.zeros_like(result)
            sink(item, result)

        return sink_dropping
