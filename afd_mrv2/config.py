"""Typed configuration parsed from ``additional_config["afd"]``.

Parsed once, into frozen (hashable) dataclasses, before any resource exists; bad input raises
:class:`~afd_mrv2.errors.ConfigError` naming the dotted key (docs/config.md).

See docs/internals/hooks-api.md, "afd_mrv2.config".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from afd_mrv2.errors import ConfigError
from afd_mrv2.items import ATTENTION, FFN, PHASES
from afd_mrv2.options import (
    FLAG,
    JSON,
    NAMES,
    TEXT,
    Check,
    integer,
    number,
    one_of,
    option,
    parse_section,
    section,
    subset_of,
)
from afd_mrv2.placement import Placement, PlacementError

ROLES = (ATTENTION, FFN)
#: What torch_p2p's pairs run on (``afd.transport``; see :mod:`afd_mrv2.mrv2.transport.store`).
TRANSPORTS = ("gloo", "zmq", "tcp")
#: Who hosts the AFD rendezvous store on ``host:port``: FFN rank 0, or someone else (``afd-mrv2 serve``'s
#: supervisor), which also lets restarted roles rejoin (``afd.rendezvous``)
RENDEZVOUS = ("ffn0", "external")
#: The communication phases (the first and last of the work item's three).
STREAM_PHASES = (PHASES[0], PHASES[-1])
BACKENDS = ("auto", "accelerator", "host", "inline", "recording")
MAX_DEPTH = 8
AUTO = "auto"
ASYNC_MOE_SPLITS = ("request", "token")
#: Stages per batch of the async-MoE split, and the most any connector runs.
ASYNC_MOE_STAGES = 2
#: The most micro-batches afd-mrv2's own MRV2 micro-batch runner splits a step into (``afd.ubatch.num_ubatches``).
MAX_UBATCHES = 4

# ------------------------------------------------------------------ the afd sections


@dataclass(frozen=True)
class BufferCounts:
    """``afd.multistream.buffers``: input and output buffer counts set apart."""

    inputs: int = option(integer(1, MAX_DEPTH), key="in")
    outputs: int = option(integer(1, MAX_DEPTH), key="out")


@dataclass(frozen=True)
class MultistreamConfig:
    """The ``afd.multistream`` section: how the shared executor schedules phases.

    enabled
        False (the default) runs every phase of every work item on one stream, in
        order: the serialized fallback.  True gives recv and send their own
        streams so they overlap compute.
    depth
        The simple knob (1..8, default 2), or ``"auto"``: sets both buffer counts
        (see ``buffers``).  Work item ``k`` fills input buffer ``k % depth`` and
        output buffer ``k % depth``; an input buffer is reused once compute
        consumed it, an output buffer once send completed, so depth 2 overlaps
        all three balanced phases.  ``"auto"`` runs the first ``auto_window``
        items with 8 of each, measures their phase times, and keeps the
        (input, output) counts the analytic model
        (:mod:`afd_mrv2.pipeline.schedule_model`) puts within 5 % of unbounded
        with the fewest buffer bytes; it logs the choice once.
    buffers
        ``{"in": N, "out": M}`` (each 1..8): input and output buffer counts set
        apart, overriding ``depth``.
    auto_window
        Work items measured before ``depth: "auto"`` decides (1..1024, default 8).
    roles
        Which AFD roles run multistream when enabled (``attention``, ``ffn``).
    phases
        Which communication phases get a stream of their own (``recv``, ``send``);
        a phase not listed runs on the compute stream.
    backend
        Stream backend: ``accelerator`` (torch.Stream/torch.Event on CUDA or NPU),
        ``host`` (a worker thread per stream), ``inline`` (every phase on the
        submitting thread: serialized only), ``recording`` (deterministic op log,
        for tests) or ``auto`` (accelerator when ``torch.accelerator`` reports one,
        else host; the serialized Attention side of a vLLM MoE layer takes inline
        instead of host).
    close_timeout_s
        Default deadline of :meth:`Executor.close`, in seconds (0 < s <= 3600).
    trace
        Record a span per phase (for Perfetto traces and overlap metrics).
    """

    enabled: bool = option(FLAG, False)
    depth: int | str = option(integer(1, MAX_DEPTH, also=(AUTO,)), 2)
    auto_window: int = option(integer(1, 1024), 8)
    roles: tuple[str, ...] = option(subset_of(ROLES), (FFN,))
    phases: tuple[str, ...] = option(subset_of(STREAM_PHASES), STREAM_PHASES)
    backend: str = option(one_of(BACKENDS), AUTO)
    close_timeout_s: float = option(number(0.0, 3600.0), 10.0)
    trace: bool = option(FLAG, False)
    buffers: BufferCounts | None = option(
        Check(
            'a mapping {"in": N, "out": M}',
            lambda v: isinstance(v, Mapping),
            lambda v, key: parse_section(BufferCounts, v, key),
        ),
        None,
    )

    @property
    def auto_depth(self) -> bool:
        return self.depth == AUTO and self.buffers is None

    @property
    def buffer_counts(self) -> tuple[int, int]:
        """(input, output) buffer slots to allocate: ``buffers``, else ``depth`` for
        both, or the most ``auto`` may choose."""
        if self.buffers is not None:
            return (self.buffers.inputs, self.buffers.outputs)
        depth = MAX_DEPTH if self.depth == AUTO else int(self.depth)
        return (depth, depth)

    @property
    def slots(self) -> int:
        """The larger buffer count (what ``depth`` sizes per-slot resources by)."""
        return max(self.buffer_counts)

    def active_for(self, role: str) -> bool:
        """True when ``role`` runs the pipelined (multistream) schedule."""
        return self.enabled and role in self.roles


@dataclass(frozen=True)
class AsyncMoeConfig:
    """The ``afd.async_moe`` section: AFD-managed two-stage MoE ubatching (CAMAsync).

    enabled
        False (the default) runs each batch as one stage.  True cuts every batch
        into two stages with :func:`afd_mrv2.stages.plan_stages` so one stage's
        MoE overlaps the other's attention.  Needs ``compute_gate_on_attention``
        (each stage dispatches its own routing).
    split
        ``request`` (cut at a request boundary) or ``token`` (cut the flattened
        tokens in half; a request may continue in stage 2 as a chunked prefill).
    num_stages
        Exactly 2: more stages are refused here, at configuration time.
    """

    enabled: bool = option(FLAG, False)
    split: str = option(one_of(ASYNC_MOE_SPLITS), "request")
    num_stages: int = option(
        integer(ASYNC_MOE_STAGES, ASYNC_MOE_STAGES, why="the async-MoE split supports exactly two stages"),
        ASYNC_MOE_STAGES,
    )

    @property
    def stages(self) -> int:
        """Stages per batch: ``num_stages`` when enabled, else 1."""
        return self.num_stages if self.enabled else 1


@dataclass(frozen=True)
class UBatchConfig:
    """The ``afd.ubatch`` section: micro-batched steps on the Attention role (vLLM's ModelRunner V2).

    num_ubatches
        1 (the default) runs every engine step as one batch: each MoE layer is one
        blocking round trip to the FFN role.  2..4 splits a step into that many
        micro-batches (afd-mrv2's own MRV2 micro-batch runner,
        :mod:`afd_mrv2.mrv2.attention.ubatch_runner`), each on its own thread: at every MoE
        layer a micro-batch sends its routed tokens, hands the core to its sibling,
        and receives the result when control returns, so one micro-batch's FFN
        round trip runs under another's attention.  This option decides; vLLM's own
        ``--enable-dbo`` / ``--ubatch-size`` do not (they stay off).  The FFN role
        follows the stage identity on the wire and ignores this section.
    decode_token_threshold
        A decode-only step (every request schedules one token) with fewer tokens
        than this runs unsplit (default 32, vLLM's ``dbo_decode_token_threshold``).
        Must be at least ``num_ubatches`` (each micro-batch needs a token).
    prefill_token_threshold
        The same for any other step (a prefill or a mixed batch; default 512,
        vLLM's ``dbo_prefill_token_threshold``).
    """

    num_ubatches: int = option(integer(1, MAX_UBATCHES), 1)
    decode_token_threshold: int = option(integer(1), 32)
    prefill_token_threshold: int = option(integer(1), 512)

    @property
    def enabled(self) -> bool:
        return self.num_ubatches > 1

    def split(self, num_tokens: int, *, uniform_decode: bool) -> int:
        """How many micro-batches a step of ``num_tokens`` runs in: ``num_ubatches``, or 1 below its threshold."""
        threshold = self.decode_token_threshold if uniform_decode else self.prefill_token_threshold
        return self.num_ubatches if self.enabled and num_tokens >= max(threshold, self.num_ubatches) else 1


def _is_table(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(
        isinstance(h, (list, tuple)) and all(type(f) is int for f in h) for h in value
    )


@dataclass(frozen=True)
class PlacementConfig:
    """The ``afd.placement`` section: which FFN ranks hold each routed expert.

    holders
        One list per expert, its FFN ranks, primary first (``[[0], [0, 1], [1]]``): 1..F distinct
        ranks each, every FFN rank holding at least one expert, as many lists as the model's routed
        experts.  Absent section: the ring with ``expert_replicas`` (balanced contiguous blocks).
    """

    holders: tuple[tuple[int, ...], ...] = option(
        Check("a list of lists of FFN ranks (integers)", _is_table, lambda v, key: tuple(tuple(h) for h in v))
    )


@dataclass(frozen=True)
class AfdConfig:
    """The whole ``afd`` section of ``additional_config``.

    The keys follow the upstream AFD plugin (``connector``, ``role``,
    ``num_attention_ranks``, ``num_ffn_ranks``, ``host``, ``port``,
    ``compute_gate_on_attention``, ``async``, ``connector_extra_config``) plus
    afd-mrv2's ``multistream`` and ``async_moe`` sections and ``observers`` (names of
    observer plugins to enable).  ``async`` is stored as ``async_mode`` (a Python keyword).
    ``ubatch`` (micro-batched steps on the Attention role) is afd-mrv2's too.
    ``rank`` is this process's rank within its role (0-based, default 0; below
    ``num_attention_ranks`` or ``num_ffn_ranks``): ``afd-mrv2 serve`` sets it per
    process.  ``num_attention_ranks`` and ``num_ffn_ranks`` are independent (any A >= 1,
    F >= 1: experts are sharded over the FFN ranks and every FFN rank serves every
    attention rank; a connector that pairs ranks checks its own rule).  ``expert_replicas``
    (1..``num_ffn_ranks``, default 1): on how many FFN ranks every routed expert lives
    (:class:`~afd_mrv2.placement.Placement`); with 2 or more, the loss of an FFN rank is
    survived by failover to the other holders (torch_p2p on the vLLM path).  ``placement``
    (:class:`PlacementConfig`): any table of holders instead of that ring (``expert_replicas`` is then
    its most holders of an expert).  ``rendezvous``
    (vLLM path): ``ffn0`` (default), FFN rank 0 hosts the rendezvous store on ``host:port``;
    ``external``, someone else does (``afd-mrv2 serve``'s supervisor), every role is a client,
    and a role that restarts rejoins its peers (:mod:`afd_mrv2.mrv2.transport.pairs`).  ``transport`` (vLLM
    path and ``afd-mrv2 run``): what torch_p2p's pairs run on, ``tcp`` (default), ``zmq`` or ``gloo``; ``bind``: the
    address a zmq or tcp pair's sockets bind (default: this host's address on the route to ``host``).
    ``attention_group_size`` (vLLM path; default 1): the Attention ranks that step in lock-step, one vLLM
    deployment's data-parallel x tensor-parallel ranks (consecutive AFD ranks, ``num_attention_ranks`` a
    multiple of it); an FFN rank computes each layer once for a whole group.  In such an engine
    (``data_parallel_size`` x ``tensor_parallel_size`` equal to it) every process gets the same section:
    ``rank`` then names the group's first AFD rank, and each process's own is
    ``rank + data_parallel_rank * tensor_parallel_size + tensor_parallel_rank`` (docs/vllm.md, "Attention groups: data and tensor parallelism (M:N)").
    ``join_timeout_s`` (vLLM path): how long an Attention engine waits for the store and for each FFN rank to
    register at its first rendezvous (default 600; ``afd-mrv2 serve`` sets its ready timeout).
    ``connector_extra_config``
    is parsed by the connector (:func:`parse_section` on its own options dataclass).
    """

    connector: str = option(TEXT)
    role: str = option(one_of(ROLES))
    rank: int = option(integer(0, (1 << 16) - 1), 0)
    num_attention_ranks: int = option(integer(1, 1 << 16), 1)
    num_ffn_ranks: int = option(integer(1, 1 << 16), 1)
    attention_group_size: int = option(integer(1, 1 << 16), 1)
    expert_replicas: int = option(integer(1, 1 << 16), 1)
    placement: PlacementConfig | None = option(
        Check(
            'a mapping {"holders": [[f, ...], ...]}',
            lambda v: isinstance(v, Mapping),
            lambda v, key: parse_section(PlacementConfig, v, key),
        ),
        None,
    )
    rendezvous: str = option(one_of(RENDEZVOUS), "ffn0")
    host: str = option(TEXT, "127.0.0.1")
    port: int = option(integer(1, 65535), 29500)
    transport: str = option(one_of(TRANSPORTS), "tcp")
    bind: str | None = option(TEXT, None)
    join_timeout_s: float = option(number(0.0), 600.0)
    compute_gate_on_attention: bool = option(FLAG, True)  # the only value the vLLM path serves; camp2p: false
    async_mode: bool = option(FLAG, False, key="async")
    observers: tuple[str, ...] = option(NAMES, ())
    connector_extra_config: tuple[tuple[str, Any], ...] = option(JSON, ())
    multistream: MultistreamConfig = section(MultistreamConfig)
    async_moe: AsyncMoeConfig = section(AsyncMoeConfig)
    ubatch: UBatchConfig = section(UBatchConfig)

    @property
    def attention_groups(self) -> tuple[tuple[int, ...], ...]:
        """The Attention ranks of each lock-step group (``attention_group_size`` consecutive ranks each)."""
        size = self.attention_group_size
        return tuple(tuple(range(g, g + size)) for g in range(0, self.num_attention_ranks, size))

    def placement_for(self, num_experts: int, *, key: str = "afd") -> Placement:
        """The placement of the model's ``num_experts`` routed experts: ``placement``'s table (its expert count
        must be the model's), else the ring; :class:`ConfigError` naming the key otherwise."""
        if self.placement is None:
            try:
                return Placement.ring(num_experts, self.num_ffn_ranks, self.expert_replicas)
            except PlacementError as exc:
                raise ConfigError(f"{key}.num_ffn_ranks", str(exc)) from None
        table = Placement.from_table(self.placement.holders, self.num_ffn_ranks)
        if table.num_experts != num_experts:
            raise ConfigError(
                f"{key}.placement.holders",
                f"the table places {table.num_experts} experts, the model has {num_experts} routed experts",
            )
        return table

    @property
    def extra(self) -> dict[str, Any]:
        """``connector_extra_config`` as a fresh dict (the stored form is hashable)."""
        return {k: _thaw(v) for k, v in self.connector_extra_config}


def parse_multistream(raw: object, *, key: str = "afd.multistream") -> MultistreamConfig:
    """Parse the ``multistream`` section (a mapping, or None for the defaults)."""
    return MultistreamConfig() if raw is None else parse_section(MultistreamConfig, raw, key)


def parse_afd_config(raw: object, *, key: str = "afd") -> AfdConfig:
    """Parse the ``afd`` section of ``additional_config``, then the checks that span keys."""
    config = parse_section(AfdConfig, raw, key)
    ranks = config.num_attention_ranks if config.role == ATTENTION else config.num_ffn_ranks
    if config.rank >= ranks:
        raise ConfigError(
            f"{key}.rank",
            f"expected an integer in 0..{ranks - 1} (num_{config.role}_ranks is {ranks}), got {config.rank}",
        )
    group = config.attention_group_size
    if config.num_attention_ranks % group:
        raise ConfigError(
            f"{key}.attention_group_size",
            f"expected a divisor of num_attention_ranks ({config.num_attention_ranks}), got {group}",
        )
    if config.role == ATTENTION and config.rank % group:
        raise ConfigError(
            f"{key}.rank",
            f"expected the first rank of an Attention group (a multiple of attention_group_size {group}), "
            f"got {config.rank}",
        )
    if config.expert_replicas > config.num_ffn_ranks:
        raise ConfigError(
            f"{key}.expert_replicas",
            f"expected an integer in 1..{config.num_ffn_ranks} (num_ffn_ranks), got {config.expert_replicas}",
        )
    if config.placement is not None:
        config = _with_table(config, key)
    if config.async_moe.enabled and not config.compute_gate_on_attention:
        raise ConfigError(
            f"{key}.async_moe.enabled",
            "the async-MoE split dispatches each stage's routing from the attention side; "
            f"set {key}.compute_gate_on_attention to true",
        )
    return config


# ------------------------------------------------------------------ helpers


def _with_table(config: AfdConfig, key: str) -> AfdConfig:
    """``config`` with ``expert_replicas`` set to its table's most holders (1 or that count may be given)."""
    assert config.placement is not None
    try:
        table = Placement.from_table(config.placement.holders, config.num_ffn_ranks)
    except PlacementError as exc:
        raise ConfigError(f"{key}.placement.holders", str(exc)) from None
    if config.expert_replicas not in (1, table.replicas):
        raise ConfigError(
            f"{key}.expert_replicas",
            f"{config.expert_replicas} disagrees with {key}.placement (the table's most holders of an expert: "
            f"{table.replicas}); leave it out",
        )
    return replace(config, expert_replicas=table.replicas)


def _thaw(value: Any) -> Any:
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "__map__":
        return {k: _thaw(v) for k, v in value[1]}
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "__seq__":
        return [_thaw(v) for v in value[1]]
    return value
