"""What one ``afd-mrv2 run`` does, identical on every rank.

The local launcher hands it to its workers as JSON (``AFD_MRV2_RUN_CONFIG``); under
torchrun every rank parses the same command line into the same value.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace

from afd_mrv2.reference.spec import ROUTINGS, BatchSpec, ModelSpec, with_routing
from afd_mrv2.topology import Topology
from afd_mrv2.ubatch import NUM_STAGES, SPLITS

LINKS = ("gloo", "sim")
CONFIG_ENV = "AFD_MRV2_RUN_CONFIG"


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
    :class:`~afd_mrv2.reference.owners.SplitAttentionOwner`.
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
    sim_latency_us: float | None = None
    sim_bandwidth_gbps: float = 0.0
    recv_timeout_s: float = 30.0
    tolerance: float = 1e-5
    out_dir: str = "out/afd-run"
    async_moe_split: str | None = None

    def __post_init__(self) -> None:
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, got {self.routing!r}")
        if self.link not in LINKS:
            raise ValueError(f"link must be one of {', '.join(LINKS)}, got {self.link!r}")
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
        with_routing(self.model, self.routing, self.topology)  # fail early on impossible scenarios
        self._check_split()

    def _check_split(self) -> None:
        """Refuse a split the planner could not apply to every batch (it would return no plan)."""
        split = self.async_moe_split
        if split is None:
            return
        if split not in SPLITS:
            raise ValueError(f"async_moe_split must be one of {', '.join(SPLITS)}, got {split!r}")
        requests = self.requests_per_batch
        if split == "request" and requests < NUM_STAGES:
            raise ValueError(
                f"--async-moe-split request needs at least {NUM_STAGES} requests per batch, got {requests}: "
                "the request split never cuts a request, so the planner has no plan for a single one "
                "(use --async-moe-split token to split it mid-prefill)"
            )
        if split == "token" and requests * self.batch.min_len < NUM_STAGES:
            raise ValueError(
                f"--async-moe-split token needs at least {NUM_STAGES} tokens per batch, but {requests} request(s) "
                f"of --min-len {self.batch.min_len} can have fewer: the planner would have no plan"
            )

    @property
    def modes(self) -> tuple[tuple[int, int], ...]:
        """The (input, output) buffer counts of each multistream mode, in run order."""
        return tuple((d, d) for d in self.depths) + tuple((i, o) for i, o in self.buffers)

    @property
    def requests_per_batch(self) -> int:
        return self.batch.stages * self.batch.requests_per_stage

    @property
    def num_stages(self) -> int:
        """Stages (work items per layer) of a batch: the planner's two under a split, else the micro-batches."""
        return NUM_STAGES if self.async_moe_split else self.batch.stages

    @property
    def topology(self) -> Topology:
        return Topology(self.num_attention, self.num_ffn, self.model.num_experts)

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
        return cls(**raw, model=ModelSpec(**model), batch=BatchSpec(**batch))

    def with_(self, **changes: object) -> RunConfig:
        return replace(self, **changes)  # type: ignore[arg-type]
