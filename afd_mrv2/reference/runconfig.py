"""What one ``afd-mrv2 run`` does, identical on every rank.

The local launcher hands it to its workers as JSON (``AFD_MRV2_RUN_CONFIG``); under
torchrun every rank parses the same command line into the same value.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from afd_mrv2 import envs
from afd_mrv2.config import TRANSPORTS
from afd_mrv2.hooks.quant_modes import QUANT_MODES
from afd_mrv2.reference.spec import ROUTINGS, BatchSpec, ModelSpec, with_routing
from afd_mrv2.stages import NUM_STAGES, SPLITS
from afd_mrv2.stages.layout import LAYOUTS
from afd_mrv2.topology import Topology

LINKS = ("gloo", "sim")
#: The launcher hands its workers the run as JSON in this variable (:data:`afd_mrv2.envs.RUN_CONFIG`).
CONFIG_ENV = envs.RUN_CONFIG.name


@dataclass(frozen=True)
class RunConfig:
    """One embedded AFD run.

    ``depths``: the multistream depths to run after the serialized baseline, each
    ``d`` input + ``d`` output buffers; then ``buffers``: (in, out) buffer counts
    set apart (:attr:`modes` lists both; the first is the headline mode).  ``link = "sim"`` adds the simulated link
    (``sim_latency_us`` per transfer, None = balanced: the FFN compute time per
    item, measured in a calibration pass).

    ``async_moe_split`` (``"token"`` or ``"request"``; None = off): each attention
    rank concatenates a batch's requests (all ``batch.stages x
    batch.requests_per_stage`` of them) and runs the async-MoE planner's two
    stages instead of the BatchSpec micro-batches; see
    :class:`~afd_mrv2.reference.split_owner.SplitAttentionOwner`.  A batch the
    planner cannot split on some attention DP rank runs unsplit on all of them
    (one collective per batch, :func:`afd_mrv2.stages.layout.decide_split`).
    ``requests`` (split only): requests per batch by DP rank and batch, DP rank
    ``a`` running ``requests[(a + b) % len(requests)]`` in batch ``b`` (empty: the
    BatchSpec's count everywhere); ``attention_tp`` TP ranks per attention DP
    rank in ``layout`` ``sp`` or ``tp`` (:mod:`afd_mrv2.stages.layout`).
    """

    num_attention: int = 2
    num_ffn: int = 1
    model: ModelSpec = field(default_factory=ModelSpec)
    batch: BatchSpec = field(default_factory=BatchSpec)
    routing: str = "balanced"
    batches: int = 3
    warmup: int = 1
    depths: tuple[int, ...] = (3,)
    buffers: tuple[tuple[int, int], ...] = ()
    link: str = "gloo"
    transport: str = "gloo"  # what the Attention-FFN pairs run on (afd.transport): gloo's one group, zmq or tcp pairs
    sim_latency_us: float | None = None
    sim_bandwidth_gbps: float = 0.0
    recv_timeout_s: float = 30.0
    tolerance: float = 1e-5
    out_dir: str = "out/afd-run"
    async_moe_split: str | None = None
    attention_tp: int = 1
    layout: str = "tp"
    requests: tuple[int, ...] = ()
    quant: str | None = None  # "w8a8": torch_p2p's quantized dispatch (tolerance: reference/quant_check.py)
    connector: str = "torch_p2p"  # an installed connector that speaks torch_p2p's resources and compute signature
    observers: tuple[str, ...] = ()  # installed observers (afd.observers) around it on every rank

    def __post_init__(self) -> None:
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, got {self.routing!r}")
        if self.link not in LINKS:
            raise ValueError(f"link must be one of {', '.join(LINKS)}, got {self.link!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {self.transport!r}")
        if self.batches < 1 or self.warmup < 0:
            raise ValueError("batches must be >= 1 and warmup >= 0")
        if not self.modes:
            raise ValueError("give at least one multistream depth or (in, out) buffer pair")
        if any(not 1 <= d <= 8 for d in self.depths):
            raise ValueError(f"each depth must be in 1..8, got {list(self.depths)}")
        if any(len(p) != 2 or not all(1 <= n <= 8 for n in p) for p in self.buffers):
            raise ValueError(f"each buffers pair must be (in, out) with counts in 1..8, got {list(self.buffers)}")
        if self.recv_timeout_s <= 0:
            raise ValueError(f"recv_timeout_s must be > 0, got {self.recv_timeout_s}")
        if self.quant is not None and self.quant not in QUANT_MODES:
            raise ValueError(f"quant must be one of {', '.join(QUANT_MODES)}, got {self.quant!r}")
        with_routing(self.model, self.routing, self.topology)  # fail early on impossible scenarios
        self._check_split()

    def _check_split(self) -> None:
        """The split's own options; a batch the planner cannot split runs unsplit (no refusal)."""
        split = self.async_moe_split
        if split is not None and split not in SPLITS:
            raise ValueError(f"async_moe_split must be one of {', '.join(SPLITS)}, got {split!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        if self.attention_tp < 1:
            raise ValueError(f"attention_tp must be >= 1, got {self.attention_tp}")
        if any(n < 1 for n in self.requests):
            raise ValueError(f"each --requests count must be >= 1, got {list(self.requests)}")
        if split is None and (self.attention_tp > 1 or self.requests):
            raise ValueError(
                "--attention-tp and --requests shape the async-MoE stages: they need --async-moe-split token|request"
            )

    @property
    def modes(self) -> tuple[tuple[int, int], ...]:
        """The (input, output) buffer counts of each multistream mode, in run order."""
        return tuple((d, d) for d in self.depths) + tuple((i, o) for i, o in self.buffers)

    @property
    def requests_per_batch(self) -> int:
        return max(self.requests) if self.requests else self.batch.stages * self.batch.requests_per_stage

    def requests_for(self, dp_rank: int, batch: int) -> int:
        """Requests of attention DP rank ``dp_rank`` in batch ``batch`` (see ``requests``)."""
        if not self.requests:
            return self.batch.stages * self.batch.requests_per_stage
        return self.requests[(dp_rank + batch) % len(self.requests)]

    def batch_spec_for(self, dp_rank: int, batch: int) -> BatchSpec:
        """The BatchSpec that :func:`~afd_mrv2.reference.batches.make_batch` draws that batch from."""
        if not self.async_moe_split:
            return self.batch
        return replace(self.batch, stages=1, requests_per_stage=self.requests_for(dp_rank, batch))

    @property
    def max_item_tokens(self) -> int:
        """Rows one work item can carry: a stage, or under a split a whole (unsplit, padded) batch."""
        if not self.async_moe_split:
            return self.batch.max_tokens
        return self.requests_per_batch * self.batch.max_len + self.attention_tp

    @property
    def attention_processes(self) -> int:
        """Attention processes: DP ranks x TP ranks (each TP rank is an endpoint of the CAM boundary)."""
        return self.num_attention * self.attention_tp

    @property
    def num_stages(self) -> int:
        """Stages (work items per layer) of a batch: the planner's two under a split, else the micro-batches."""
        return NUM_STAGES if self.async_moe_split else self.batch.stages

    @property
    def topology(self) -> Topology:
        return Topology(self.attention_processes, self.num_ffn, self.model.num_experts)

    @property
    def routed_model(self) -> ModelSpec:
        return with_routing(self.model, self.routing, self.topology)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RunConfig:
        raw = json.loads(text)
        model, batch = raw.pop("model"), raw.pop("batch")
        model["blocked_experts"] = tuple(model["blocked_experts"])
        raw["depths"] = tuple(raw["depths"])
        raw["buffers"] = tuple(tuple(p) for p in raw.get("buffers", ()))
        raw["requests"] = tuple(raw.get("requests", ()))
        raw["observers"] = tuple(raw.get("observers", ()))
        return cls(**raw, model=ModelSpec(**model), batch=BatchSpec(**batch))

    def with_(self, **changes: Any) -> RunConfig:
        """A copy with ``changes`` (field name -> value; ``dataclasses.replace`` refuses an unknown name)."""
        return replace(self, **changes)
