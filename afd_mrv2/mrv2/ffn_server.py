"""FFN role, serving side: the shared executor's FFN loop around the real routed experts.

No vLLM import here: the FFN worker (:mod:`afd_mrv2.mrv2.worker_ext`) hands
:func:`serve_ffn` one callable per MoE layer, in model order (each is vLLM's own
``RoutedExperts.forward_modular`` of the loaded model: vLLM's loader, quant
method and kernel), and this module runs what every AFD FFN rank runs: the
``p2p_link`` (:mod:`afd_mrv2.mrv2.p2p_link`), the executor (role ffn) with the
configured connector, driven by :class:`~afd_mrv2.mrv2.ffn.FfnLoop`.

Work item ``k`` is MoE layer ``k % L`` (``L`` = number of MoE layers of the
loaded model), stage 0, seq ``k``: the Attention side numbers its items the same
way (:mod:`afd_mrv2.mrv2.remote`), and torch_p2p checks every header against it.

The loop ends when the Attention rank leaves (its process exits or fails): the
connector reports the lost peer, the executor stops, and :func:`serve_ffn`
returns a :class:`FfnReport` saying why.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from afd_mrv2.config import AfdConfig, parse_afd_config
from afd_mrv2.devices import make_backend
from afd_mrv2.errors import ConfigError, PipelineError
from afd_mrv2.hooks.p2p import P2pShape, PeerLink
from afd_mrv2.items import FFN, WorkItem
from afd_mrv2.mrv2.ffn import FfnLoop
from afd_mrv2.mrv2.p2p_link import IDLE_TIMEOUT_S, open_peer_link
from afd_mrv2.mrv2.remote import MoeShape
from afd_mrv2.pipeline.executor import Executor
from afd_mrv2.plugins import load_plugins
from afd_mrv2.topology import Topology

#: One MoE layer's routed experts: ``(x [N, H], topk_weights [N, k], topk_ids [N, k] int32) -> [N, H]``.
ExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def ffn_serving_config(raw_afd: Mapping[str, Any]) -> AfdConfig:
    """Parse the FFN role's ``afd`` section for serving.

    A serving FFN rank waits for the next item as long as its Attention engine is
    idle, so torch_p2p's ``recv_timeout_s`` defaults to a week here (a dead
    Attention process is still noticed at once, through the link's control
    channel); an explicit value is kept.
    """
    raw = dict(raw_afd)
    if raw.get("connector") == "torch_p2p":
        extra = dict(raw.get("connector_extra_config") or {})
        extra.setdefault("recv_timeout_s", IDLE_TIMEOUT_S)
        raw["connector_extra_config"] = extra
    config = parse_afd_config(raw)
    if config.role != FFN:
        raise ConfigError("afd.role", f"expected ffn for the FFN role process, got {config.role!r}")
    return config


@dataclass
class FfnReport:
    """How an FFN serving session went."""

    moe_layers: int
    items: int = 0
    busy_s: float = 0.0
    end: str = ""
    tokens_per_item: Counter[int] = field(default_factory=Counter)

    def record(self, tokens: int, seconds: float) -> None:
        self.items += 1
        self.busy_s += seconds
        self.tokens_per_item[tokens] += 1

    def as_dict(self) -> dict[str, Any]:
        return {
            "moe_layers": self.moe_layers,
            "items": self.items,
            "busy_s": round(self.busy_s, 6),
            "end": self.end,
            "tokens_per_item": dict(sorted(self.tokens_per_item.items())),
        }


def serve_ffn(
    config: AfdConfig,
    experts: Sequence[ExpertsFn],
    shape: MoeShape,
    *,
    max_tokens: int,
    dtype: torch.dtype,
    device: torch.device,
    index: int = 0,
    link: PeerLink | None = None,
) -> FfnReport:
    """Serve ``experts`` to the Attention ranks until they leave; see the module docstring.

    :param max_tokens: the most tokens one Attention forward hands a MoE layer.
    :param dtype: the dtype the experts compute in (the wire carries fp32).
    :param device: where the experts' weights live.
    :param index: this FFN rank's index (experts outside its block get weight 0).
    :param link: an already-open link (tests); by default one is opened on ``afd.host:afd.port``.
    """
    if not experts:
        raise ValueError("the FFN role needs at least one MoE layer; the loaded model has none")
    topology = Topology(config.num_attention_ranks, config.num_ffn_ranks, shape.num_experts)
    if link is None:
        link = open_peer_link(topology, topology.global_rank(FFN, index), host=config.host, port=config.port)
    local = topology.experts_of(index)
    report = FfnReport(moe_layers=len(experts))

    def compute(item: WorkItem, hidden: torch.Tensor, topk_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if topology.num_ffn > 1:  # this rank's partial sum: the other ranks' experts count 0 here
            weights = weights * ((topk_ids >= local.start) & (topk_ids < local.stop))
        start = time.perf_counter()
        with torch.inference_mode():
            out = experts[item.layer_idx](
                hidden.to(device=device, dtype=dtype),
                weights.to(device=device),
                topk_ids.to(device=device, dtype=torch.int32),
            )
        report.record(hidden.shape[0], time.perf_counter() - start)
        return out

    p2p_shape = P2pShape(shape.hidden_size, shape.top_k, shape.num_experts, len(experts), max_tokens)
    plugins = load_plugins(config, resources={"p2p_link": link, "model": p2p_shape})
    executor = Executor(
        plugins, make_backend(config.multistream.backend), config.multistream, compute=compute, role=FFN
    )
    loop = FfnLoop(executor, num_layers=len(experts), num_stages=1)
    end = "stopped"
    try:
        while True:
            loop.step()
    except PipelineError as exc:
        end = str(exc).splitlines()[0]
    finally:
        loop.close()
    return replace(report, end=end)
