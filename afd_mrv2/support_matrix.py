"""The first support matrix, enforced: refuse unsupported combinations at configuration time.

The ``afd`` section cannot see vLLM's own settings (native DBO, graph mode,
parallel sizes), so they are described in a :class:`Deployment` and
:func:`check_deployment` runs right after parsing, before any stream, thread or
communicator exists.  On the vLLM path the Deployment is read from the engine's
real ``VllmConfig`` (:mod:`afd_mrv2.mrv2.deployment`, which says where each role
checks it); the CAM connectors run the same check when their owner hands them
the ``deployment`` resource.  Errors are one line, naming the key:

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
* multistream outside eager mode, for the role whose executor runs pipelined
  (``afd.multistream`` active for ``afd.role``): the executor's phases and host
  waits are not capturable; graph mode keeps the serialized path.
* more than two stages: refused where the stage count is configured
  (``afd.async_moe.num_stages``, the CAMP2P ``hccl_groups`` resource) and here
  for vLLM's native micro-batching (``--ubatch-size`` above 2).

A fact the runtime could not read (its vLLM lacks the field, see
:attr:`Deployment.unknown`) refuses every rule that needs it, naming the
missing field: the matrix never passes a combination it could not check.
"""

from __future__ import annotations

from dataclasses import dataclass

from afd_mrv2.config import ASYNC_MOE_STAGES, AfdConfig
from afd_mrv2.errors import ConfigError


@dataclass(frozen=True)
class Deployment:
    """The vLLM-side facts the support matrix depends on (from ``VllmConfig``)."""

    native_dbo: bool = False  # parallel_config.use_ubatching (--enable-dbo, or --ubatch-size above 1)
    num_ubatches: int = 2  # parallel_config.num_ubatches: micro-batches per step under native_dbo
    enforce_eager: bool = True  # no graph capture, no torch.compile (model_config.enforce_eager)
    data_parallel_size: int = 1
    tensor_parallel_size: int = 1
    sequence_parallel: bool = False
    prefill_context_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    #: (fact, where it comes from) for each fact above the runtime could not read: its
    #: value here is the default, and every rule that needs it refuses (:func:`check_deployment`)
    unknown: tuple[tuple[str, str], ...] = ()


def _known(deployment: Deployment, key: str, *facts: str) -> None:
    """Refuse, naming ``key``, when a fact the rule for ``key`` needs could not be read."""
    for fact, where in deployment.unknown:
        if fact in facts:
            raise ConfigError(key, f"cannot check {fact} against the support matrix: this vLLM's config has no {where}")


def check_deployment(config: AfdConfig, deployment: Deployment) -> None:
    """Raise :class:`ConfigError` for the first unsupported combination; see the module docstring."""
    camasync = config.connector == "camasync"
    moe = config.async_moe
    if camasync:
        key = "afd.async_moe.enabled" if moe.enabled else "afd.connector"
        _known(deployment, key, "native_dbo")
        if deployment.native_dbo:
            raise ConfigError(
                key,
                "vLLM native DBO (--enable-dbo) cannot be combined with CAMAsync"
                + (" async-MoE ubatching" if moe.enabled else "")
                + "; CAMAsync stages its MoE itself (afd.async_moe): disable native DBO",
            )
        _known(deployment, "afd.connector", "enforce_eager")
        if not deployment.enforce_eager:
            raise ConfigError(
                "afd.connector", "CAMAsync runs eager only (its operators have no graph path); set enforce_eager"
            )
    if moe.enabled:
        _known(deployment, "afd.async_moe.enabled", "decode_context_parallel_size")
        if deployment.decode_context_parallel_size > 1:
            raise ConfigError(
                "afd.async_moe.enabled",
                f"async-MoE ubatching does not rebuild decode-context-parallel metadata; "
                f"got decode_context_parallel_size={deployment.decode_context_parallel_size}",
            )
    if moe.enabled and moe.split == "token":
        _known(deployment, "afd.async_moe.split", "prefill_context_parallel_size")
        if deployment.prefill_context_parallel_size > 1:
            raise ConfigError(
                "afd.async_moe.split",
                f"the token split is defined for non-PCP layouts; with prefill_context_parallel_size="
                f"{deployment.prefill_context_parallel_size} use the request split",
            )
    if config.multistream.active_for(config.role):
        _known(deployment, "afd.multistream.enabled", "enforce_eager")
        if not deployment.enforce_eager:
            raise ConfigError(
                "afd.multistream.enabled",
                f"multistream runs eager only (graph capture records the serialized path) and is active for "
                f"role {config.role}; set enforce_eager or leave {config.role} out of afd.multistream.roles",
            )
    _known(deployment, "afd.connector", "native_dbo", "num_ubatches")
    if deployment.native_dbo and deployment.num_ubatches > ASYNC_MOE_STAGES:
        raise ConfigError(
            "afd.connector",
            f"vLLM native micro-batching runs {deployment.num_ubatches} micro-batches per step (--ubatch-size); "
            f"AFD pairs at most {ASYNC_MOE_STAGES} stages per step: use --enable-dbo or --ubatch-size 2",
        )
