"""The first support matrix, enforced: refuse unsupported combinations at configuration time.

The ``afd`` section cannot see vLLM's own settings (native DBO, graph mode,
parallel sizes), so the runner describes them in a :class:`Deployment` and calls
:func:`check_deployment` right after parsing, before any stream, thread or
communicator exists.  The CAM connectors run the same check when the runner
hands them the ``deployment`` resource.  Errors are one line, naming the key:

    afd.async_moe.enabled: vLLM native DBO (--enable-dbo) cannot be combined ...

What is refused, and why (see docs/rfc/0001-shared-stream-pipeline.md, "Support matrix"):

* CAMAsync with vLLM native DBO/ubatching: CAMAsync stages its MoE itself
  (``afd.async_moe``); two ubatching schemes would both split the batch and
  pair dispatches differently.
* CAMAsync outside eager mode: the CAM async operators have no graph path.
* async-MoE ubatching with decode context parallelism: the stage metadata
  rebuild does not cover DCP metadata.
* the ``token`` split with prefill context parallelism: PCP shards each request
  across ranks; the token split cuts inside requests and is defined for non-PCP
  DP+TP/SP layouts (PCP keeps the ``request`` split).
* multistream with graph capture: the executor's phases and host waits are not
  capturable; graph mode keeps the serialized path.
* more than two stages: refused where the stage count is configured
  (``afd.async_moe.num_stages``, the CAMP2P ``hccl_groups`` resource).
"""

from __future__ import annotations

from dataclasses import dataclass

from afd_mrv2.config import AfdConfig
from afd_mrv2.errors import ConfigError


@dataclass(frozen=True)
class Deployment:
    """The vLLM-side facts the support matrix depends on (from ``VllmConfig``)."""

    native_dbo: bool = False  # parallel_config.enable_dbo / use_ubatching
    enforce_eager: bool = True  # model_config.enforce_eager
    data_parallel_size: int = 1
    tensor_parallel_size: int = 1
    sequence_parallel: bool = False
    prefill_context_parallel_size: int = 1
    decode_context_parallel_size: int = 1


def check_deployment(config: AfdConfig, deployment: Deployment) -> None:
    """Raise :class:`ConfigError` for the first unsupported combination; see the module docstring."""
    camasync = config.connector == "camasync"
    moe = config.async_moe
    if camasync and deployment.native_dbo:
        key = "afd.async_moe.enabled" if moe.enabled else "afd.connector"
        raise ConfigError(
            key,
            "vLLM native DBO (--enable-dbo) cannot be combined with CAMAsync"
            + (" async-MoE ubatching" if moe.enabled else "")
            + "; CAMAsync stages its MoE itself (afd.async_moe): disable native DBO",
        )
    if camasync and not deployment.enforce_eager:
        raise ConfigError(
            "afd.connector", "CAMAsync runs eager only (its operators have no graph path); set enforce_eager"
        )
    if moe.enabled and deployment.decode_context_parallel_size > 1:
        raise ConfigError(
            "afd.async_moe.enabled",
            f"async-MoE ubatching does not rebuild decode-context-parallel metadata; "
            f"got decode_context_parallel_size={deployment.decode_context_parallel_size}",
        )
    if moe.enabled and moe.split == "token" and deployment.prefill_context_parallel_size > 1:
        raise ConfigError(
            "afd.async_moe.split",
            f"the token split is defined for non-PCP layouts; with prefill_context_parallel_size="
            f"{deployment.prefill_context_parallel_size} use the request split",
        )
    if config.multistream.enabled and not deployment.enforce_eager:
        raise ConfigError(
            "afd.multistream.enabled",
            "multistream runs eager only (graph capture records the serialized path); set enforce_eager or disable multistream",
        )
