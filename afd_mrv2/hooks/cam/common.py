"""What the two Ascend connectors share besides the executor: model spec, set-up.

Also the attention side's phase hooks and the buffer/transfer-state rule both follow.

See docs/internals/cam-connectors.md, "afd_mrv2.hooks.cam.common".
"""

from __future__ import annotations

import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import torch

from afd_mrv2.config import ASYNC_MOE_STAGES
from afd_mrv2.devices.base import Stream
from afd_mrv2.errors import ConfigError, PluginError
from afd_mrv2.hooks.cam.evidence import StreamBehaviour
from afd_mrv2.hooks.cam.ops import OpSet, installed_versions, load_evidence, torch_opset
from afd_mrv2.hooks.cam.stage_tags import STAGE_TAGS_RESOURCE, StageTags, check_stage
from afd_mrv2.hookspecs import ComputeFn, hookimpl
from afd_mrv2.items import WorkItem
from afd_mrv2.plugins import ConnectorContext, RoleContext
from afd_mrv2.stages.pairing import PendingFifo, check_attention_depth
from afd_mrv2.support_matrix import check_deployment
from afd_mrv2.topology import ATTENTION, FFN
from afd_mrv2.work import Work

#: Name of the context field (``cam_ops``) of the CAM operators to use instead of resolving
#: ``torch.ops.<namespace>``: an :class:`OpSet` the embedding code builds (tests pass doubles, a
#: runner may pass wrapped real operators).  Only code can provide it (the context is not
#: configuration); without it the connector resolves the real operators.
OPS_RESOURCE = "cam_ops"
#: Its name before hook API 1 (served with a DeprecationWarning).
OLD_OPS_RESOURCE = "cam_test_ops"


@dataclass(frozen=True)
class CamModelSpec:
    """The model facts the connectors size their operators with (context field ``model``)."""

    hidden_size: int
    topk: int
    num_experts: int
    num_layers: int
    dtype: torch.dtype = torch.bfloat16


def wait_until_idle(stream: Stream, work: Work, poll_s: float = 2e-4) -> None:
    """Before a host read of a device result: poll the stream, honouring cancellation.

    A plain ``.item()`` / ``.tolist()`` would block the executor's thread inside
    the runtime until the stream drains, forever if the peer died.  Polling
    ``query()`` waits for the same thing (this one stream, never the device) but
    lets shutdown and failures elsewhere through.  Streams of the CPU backends
    have no native handle: their hooks run in stream order already.
    """
    native = stream.native
    if native is None:
        return
    while not native.query():
        work.raise_if_cancelled()
        time.sleep(poll_s)


T = TypeVar("T")

#: ``work.transfer`` key of the connector's per-item transfer state (see docs/internals/cam-connectors.md)
TRANSFER = "cam"


def _checked(value: object, name: str, kind: type[T]) -> T:
    """``value``, or a :class:`PluginError` when it is not a ``kind`` (a bool is no int)."""
    if not isinstance(value, kind) or isinstance(value, bool):
        raise PluginError(f"runtime resource {name!r} must be a {kind.__name__}, got {type(value).__name__}")
    return value


class CamConnectorBase(ABC):
    """Start-up and cleanup shared by the Ascend connectors, one subclass per (family, role).

    The entry point names a family class (``CamP2PConnector``, ``CamAsyncConnector``);
    calling it builds the family's class for ``afd.role`` (:meth:`role_class`), so
    the phase hooks of each role live in their own class and no hook branches on
    the role.  The abstract phase hooks declared here are what
    :func:`afd_mrv2.plugins.classify` reads to know a family class is a connector.
    """

    name: ClassVar[str] = "cam"
    #: the runtime-pair capability this connector needs (:mod:`afd_mrv2.compat`)
    required_capability: ClassVar[str | None] = None
    hook_api_version: ClassVar[int] = 2
    #: the role this class serves; set by the role classes
    role: ClassVar[str] = ""
    #: the operators this role's recv / send phases call (start-up capability check)
    recv_ops: ClassVar[tuple[str, ...]] = ()
    send_ops: ClassVar[tuple[str, ...]] = ()
    #: the side channel stage identities travel on (:mod:`afd_mrv2.hooks.cam.stage_tags`); None: operator order
    stage_tags: StageTags | None = None

    @property
    @abstractmethod
    def world_rank(self) -> int:
        """This rank in the operators' world numbering (each family defines it)."""

    def __new__(cls, context: ConnectorContext) -> CamConnectorBase:
        role = context.config.role
        chosen = cls.role_class(role)
        if chosen is None:
            raise PluginError(f"connector {cls.name!r}: {cls.__name__} has no class for afd.role {role!r}")
        return super().__new__(chosen)

    @classmethod
    def role_class(cls, role: str) -> type[CamConnectorBase] | None:
        """The class that serves ``role``: a role class itself, or the family class's subclass for it."""
        if cls.role:
            return cls if cls.role == role else None
        return next((sub for sub in cls.__subclasses__() if sub.role == role), None)

    def __init__(self, context: ConnectorContext) -> None:
        context = context.typed()
        config = context.config
        self.config = config
        if context.deployment is not None:
            check_deployment(config, context.deployment)
        self.pipelined = config.multistream.active_for(config.role)
        self.model: CamModelSpec = _checked(context.need(context.model, "model"), "model", CamModelSpec)
        self.role_rank: int = _checked(context.need(context.role_rank, "role_rank"), "role_rank", int)
        size = config.num_attention_ranks if self.role == ATTENTION else config.num_ffn_ranks
        if not 0 <= self.role_rank < size:
            raise PluginError(
                f"connector {self.name!r}: role_rank {self.role_rank} is outside 0..{size - 1} for role {self.role}"
            )
        self.num_attention, self.num_ffn = config.num_attention_ranks, config.num_ffn_ranks
        self.device = torch.device(context.device or "cpu")

    def _ops(
        self,
        context: RoleContext,
        *,
        namespace: str,
        known: Mapping[str, tuple[StreamBehaviour, str]],
        install_hint: str,
    ) -> OpSet:
        """The test doubles when the test switch is set, else the real operators of
        ``torch.ops.<namespace>`` (with any stream evidence from the options); then
        the start-up capability check of this role's operators."""
        ops = context.cam_ops
        if ops is None and OLD_OPS_RESOURCE in context.extras:
            warnings.warn(
                f"resource {OLD_OPS_RESOURCE!r} is deprecated since hook API 1: use {OPS_RESOURCE!r}",
                DeprecationWarning,
                stacklevel=2,
            )
            ops = context.extras[OLD_OPS_RESOURCE]
        if ops is None:
            evidence = load_evidence(context.config.extra, "afd.connector_extra_config.stream_evidence")
            ops = torch_opset(
                namespace, known, evidence=evidence, environment=installed_versions(), install_hint=install_hint
            )
        elif not isinstance(ops, OpSet):
            raise PluginError(f"resource {OPS_RESOURCE!r} must be an OpSet (afd_mrv2.hooks.cam.ops)")
        ops.check_start_up(self.recv_ops, self.send_ops, connector=self.name, pipelined=self.pipelined)
        tags = context.cam_stage_tags
        if tags is not None and not isinstance(tags, StageTags):
            raise PluginError(
                f"runtime resource {STAGE_TAGS_RESOURCE!r} must be a StageTags, got {type(tags).__name__}"
            )
        self.stage_tags = ops.stage_tags if tags is None else tags
        return ops

    def describe_world(self, world: int) -> str:
        """``attention rank a`` / ``FFN rank f`` of operator world rank ``world`` (each family's numbering)."""
        return f"{self.name} world rank {world}"

    def _stamp(self, stage: WorkItem) -> None:
        """Before a send operator: the identity of the transfer it sends goes on the side channel."""
        if self.stage_tags is not None:
            self.stage_tags.stamp(self.world_rank, stage)

    def _check_stage_from(self, sender: int, expected: WorkItem, what: str) -> WorkItem | None:
        """After a receive operator: the identity of what ``sender`` sent must be ``expected``; returns it.

        Without a side channel nothing can be checked (the operators' order is trusted): returns None.
        """
        if self.stage_tags is None:
            return None
        got = self.stage_tags.take(self.world_rank, sender)
        check_stage(
            got,
            expected,
            connector=self.name,
            what=what,
            sender_name=self.describe_world(sender),
            receiver_name=self.describe_world(self.world_rank),
        )
        return got

    def _check_stages(self, stages: int, what: str) -> None:
        if not 1 <= stages <= ASYNC_MOE_STAGES:
            raise ConfigError(
                what, f"expected 1..{ASYNC_MOE_STAGES} stages (more than two stages is not supported), got {stages}"
            )
        self._check_depth(stages)

    def _check_depth(self, stages: int) -> None:
        """Role-specific check of the buffer counts against the stage count (the FFN side has none)."""
        del stages

    def _pending(self) -> tuple[PendingFifo[Any], ...]:
        """Transfer state parked between items; dropped on cleanup."""
        return ()

    # ------------------------------------------------------------------ hooks

    @hookimpl
    @abstractmethod
    def on_recv(self, work: Work, stream: Stream) -> None: ...

    @hookimpl
    @abstractmethod
    def on_compute(self, work: Work, compute: ComputeFn) -> None: ...

    @hookimpl
    @abstractmethod
    def on_send(self, work: Work, stream: Stream) -> None: ...

    @hookimpl
    def on_cleanup(self, work: Work, error: BaseException) -> None:
        del error
        work.transfer.pop(TRANSFER, None)
        work.inputs.state = work.outputs.state = None  # the executor has stopped: nothing reuses them
        for fifo in self._pending():
            fifo.clear()


class CamAttentionBase(CamConnectorBase):
    """The attention side of either family: layer 0 reads ``source``, the last item feeds ``sink``.

    In between, recv combines what the same stage dispatched one layer earlier
    (parked in ``self._sent``) and send dispatches this layer; the family class
    says how (:meth:`_combine`, :meth:`_dispatch`).
    """

    role = ATTENTION
    _sent: PendingFifo[Any]

    def __init__(self, context: ConnectorContext) -> None:
        super().__init__(context)
        context = context.typed()
        self.source: Callable[[WorkItem], torch.Tensor] = context.need(context.source, "source")
        self.sink: Callable[[WorkItem, torch.Tensor], None] = context.need(context.sink, "sink")

    @abstractmethod
    def _combine(self, stream: Stream, sent: Any) -> Any:
        """Receive the FFN output for the dispatch ``sent``; returns compute's input."""

    @abstractmethod
    def _dispatch(self, work: Work, stream: Stream, outputs: Any) -> None:
        """Send compute's ``outputs`` for this item and park what the combine needs in ``self._sent``."""

    def _check_depth(self, stages: int) -> None:
        multistream = self.config.multistream
        key = "afd.multistream.depth" if multistream.buffers is None else "afd.multistream.buffers"
        check_attention_depth(multistream.buffer_counts, stages, pipelined=self.pipelined, key=key)

    def _pending(self) -> tuple[PendingFifo[Any], ...]:
        return (self._sent,)

    @hookimpl
    def on_recv(self, work: Work, stream: Stream) -> None:
        item = work.item
        if item.layer_idx == 0:
            work.inputs.state = self.source(item)
            return
        # the dispatch this item combines: per-item transfer state, kept (with the
        # operator arguments it holds) until this item's send returned
        sent = work.transfer[TRANSFER] = self._sent.pop(
            WorkItem.stage(item.layer_idx - 1, item.stage_idx, item.num_stages)
        )
        work.inputs.state = self._combine(stream, sent)

    @hookimpl
    def on_compute(self, work: Work, compute: ComputeFn) -> None:
        work.outputs.state = compute(work.item, work.inputs.state)

    @hookimpl
    def on_send(self, work: Work, stream: Stream) -> None:
        item, outputs = work.item, work.outputs.state
        if item.layer_idx == self.model.num_layers:
            self.sink(item, outputs)
            return
        self._dispatch(work, stream, outputs)


class CamFfnBase(CamConnectorBase):
    """The FFN side of either family; the family class implements the three phases."""

    role = FFN
