"""TEST ONLY: a third-party ``afd_mrv2`` connector that mispairs the micro-batches of a split step.

Not part of afd-mrv2 and never in its entry points.  tests/vllm/test_serve_ubatch.py
installs it like any third party (a temporary site folder with an
``afd_mrv2_test_swap-0.0.0.dist-info`` whose ``entry_points.txt`` declares
``[afd_mrv2] swap_ubatches = afd_mrv2_test_swap:SwapUBatchesConnector``) and serves
with ``--ubatches 2 --connector swap_ubatches``.

``SwapUBatchesConnector`` is torch_p2p in every respect (the same messages, the same
FFN side, every item makes its full round trip with its own stage identity) except
one: on the round-trip Attention side, the result delivered to micro-batch 1 of a
split step is micro-batch 0's result of the same layer (its rows, cycled to
micro-batch 1's token count): the results of the two micro-batches are swapped onto
the wrong micro-batch, as a pairing by arrival order instead of by stage identity
would do.  (Micro-batch 0 has consumed its own result by the time micro-batch 1's
arrives, so only micro-batch 1 can be handed the other's.)  Each swap prints one
line with the running count.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from afd_mrv2.hooks.p2p.torch_p2p import TorchP2pConnector
from afd_mrv2.items import WorkItem
from afd_mrv2.plugins import ConnectorContext

MARK = "afd_mrv2_test_swap:"


class SwapUBatchesConnector(TorchP2pConnector):
    """torch_p2p whose Attention side hands micro-batch 1 micro-batch 0's result (see the module docstring)."""

    carries_stage_identity: ClassVar[bool] = True  # it does carry it on the wire: the mispairing is local

    def __init__(self, context: ConnectorContext) -> None:
        self.swaps = 0
        self._first: dict[int, torch.Tensor] = {}  # layer -> micro-batch 0's result of the current step
        resources = dict(context.resources)
        swapping = "sink" in resources
        if swapping:
            resources["sink"] = self._swapping(resources["sink"])
        super().__init__(ConnectorContext(config=context.config, resources=resources))
        what = "hands micro-batch 1 micro-batch 0's results" if swapping else "unchanged torch_p2p"
        print(f"{MARK} loaded on the {context.config.role} role: {what}", flush=True)

    def _swapping(self, sink: Any) -> Any:
        def sink_swapping(item: WorkItem, result: torch.Tensor) -> None:
            if item.num_stages == 2 and item.stage_idx == 0:
                self._first[item.layer_idx] = result.clone()
            elif item.num_stages == 2 and item.stage_idx == 1 and item.layer_idx in self._first:
                other = self._first.pop(item.layer_idx)
                result = other[torch.arange(result.shape[0]) % max(1, other.shape[0])]
                self.swaps += 1
                print(f"{MARK} swapped {item} tokens={result.shape[0]} swaps={self.swaps}", flush=True)
            sink(item, result)

        return sink_swapping
