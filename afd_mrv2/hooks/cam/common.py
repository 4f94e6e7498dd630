"""What the two Ascend connectors share besides the executor: model spec, set-up.

Everything connector-specific lives in :mod:`camp2p` / :mod:`camasync` (their
options in :mod:`~afd_mrv2.hooks.cam.options`); this module only holds the
pieces both need to start up the same way: read the runtime resources, resolve
the operators (or take the explicit test doubles) and run the start-up checks,
all before any communication happens.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from afd_mrv2.config import ASYNC_MOE_STAGES
from afd_mrv2.devices.base import Stream
from afd_mrv2.errors import ConfigError, PluginError
from afd_mrv2.hooks.cam.evidence import StreamBehaviour
from afd_mrv2.hooks.cam.ops import OpSet, installed_versions, load_evidence, torch_opset
from afd_mrv2.items import WorkItem
from afd_mrv2.plugins import ConnectorContext
from afd_mrv2.support_matrix import check_deployment
from afd_mrv2.work import Work

#: Resource name of the explicit test switch: an :class:`OpSet` built by
#: :mod:`afd_mrv2.testing`.  Only code can provide it (resources are
#: not configuration), and nothing provides it by default.
TEST_OPS_RESOURCE = "cam_test_ops"


@dataclass(frozen=True)
class CamModelSpec:
    """The model facts the connectors size their operators with (resource ``model``)."""

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


class CamConnectorBase:
    """Start-up shared by both Ascend connectors; the hooks live in the subclasses."""

    name = "cam"

    def __init__(self, context: ConnectorContext) -> None:
        config = context.config
        self.config = config
        deployment = context.resources.get("deployment")
        if deployment is not None:
            check_deployment(config, deployment)
        self.role = config.role
        self.pipelined = config.multistream.active_for(config.role)
        self.model: CamModelSpec = self._resource(context, "model", CamModelSpec)
        self.role_rank: int = self._resource(context, "role_rank", int)
        size = config.num_attention_ranks if self.role == "attention" else config.num_ffn_ranks
        if not 0 <= self.role_rank < size:
            raise PluginError(
                f"connector {self.name!r}: role_rank {self.role_rank} is outside 0..{size - 1} for role {self.role}"
            )
        if self.role == "attention":
            self.source: Callable[[WorkItem], torch.Tensor] = context.resource("source")
            self.sink: Callable[[WorkItem, torch.Tensor], None] = context.resource("sink")

    @staticmethod
    def _resource(context: ConnectorContext, name: str, kind: type) -> Any:
        value = context.resource(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise PluginError(f"runtime resource {name!r} must be a {kind.__name__}, got {type(value).__name__}")
        return value

    def _ops(
        self,
        context: ConnectorContext,
        *,
        namespace: str,
        known: Mapping[str, tuple[StreamBehaviour, str]],
        install_hint: str,
        recv: tuple[str, ...],
        send: tuple[str, ...],
    ) -> OpSet:
        """The test doubles when the test switch is set, else the real operators of
        ``torch.ops.<namespace>`` (with any stream evidence from the options); then
        the start-up capability check."""
        ops = context.resources.get(TEST_OPS_RESOURCE)
        if ops is None:
            evidence = load_evidence(context.config.extra, "afd.connector_extra_config.stream_evidence")
            ops = torch_opset(
                namespace, known, evidence=evidence, environment=installed_versions(), install_hint=install_hint
            )
        elif not isinstance(ops, OpSet):
            raise PluginError(f"resource {TEST_OPS_RESOURCE!r} must be an OpSet from afd_mrv2.testing")
        ops.check_start_up(recv, send, connector=self.name, pipelined=self.pipelined)
        return ops

    def _check_stages(self, stages: int, what: str) -> None:
        if not 1 <= stages <= ASYNC_MOE_STAGES:
            raise ConfigError(
                what, f"expected 1..{ASYNC_MOE_STAGES} stages (more than two stages is not supported), got {stages}"
            )
