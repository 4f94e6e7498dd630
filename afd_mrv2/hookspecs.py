"""The afd-mrv2 hook specifications: the extension manual for connectors and observers.

Each spec's docstring below is the manual for that hook (writing a connector: docs/connectors.md).

See docs/internals/hooks-api.md, "afd_mrv2.hookspecs".
"""

from __future__ import annotations

from typing import Any, Protocol

import pluggy

from afd_mrv2.config import MultistreamConfig
from afd_mrv2.devices.base import DeviceBackend, Stream
from afd_mrv2.items import WorkItem
from afd_mrv2.work import Work

PROJECT_NAME = "afd_mrv2"

#: The version of the hook API these specs, ``Work``, ``BufferSlot``, ``WorkItem`` and the
#: connector context make up (:mod:`afd_mrv2.api` lists the surface).  It changes, by one,
#: with every change a plugin can notice; CHANGELOG.md records each.  A plugin declares the
#: version it was written for as the class attribute ``hook_api_version`` of the factory its
#: entry point names; one that declares none was written before versioning: API 0.
#: API 2: the typed context per role (``AttentionContext`` / ``FfnContext``) and the declared
#: capabilities (``SupportsFailover``, ``InFlightSink``); CHANGELOG.md says what to change.
HOOK_API_VERSION = 2

#: The oldest hook API version still served (through compatibility shims): a renamed or
#: removed member keeps working, with a ``DeprecationWarning``, for one more API version.
OLDEST_SERVED_HOOK_API = 0

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


#: The owner's compute function, handed to ``on_compute``.  Its signature is a
#: contract between the executor's owner (the model runner) and the connector, so each
#: connector documents its own (``torch_p2p``: :mod:`afd_mrv2.hooks.p2p.torch_p2p`;
#: ``camasync``: :mod:`afd_mrv2.hooks.cam.camasync`; docs/connectors.md tabulates them).
class ComputeFn(Protocol):
    """``compute(item, *payload) -> result``: the work item first, then what the connector received.

    Quantized transfers hand compute what was received, scales included, never
    a copy the connector dequantized behind compute's back: the received
    dynamic scales are part of the payload, read only after recv completed
    (the recv -> compute event edge covers them like the rows).
    """

    def __call__(self, item: WorkItem, /, *payload: Any) -> Any: ...


# ---------------------------------------------------------------- set-up: once per executor


@hookspec(firstresult=True)
def create_streams(
    backend: DeviceBackend, roles: tuple[str, ...], config: MultistreamConfig
) -> dict[str, Stream] | None:
    """Create the streams for ``roles`` and return them as ``{role: stream}``.

    Called once, on the thread that builds the executor (or the vLLM runner
    wrapper), before any work is submitted.  The executor asks for the roles
    ``("recv", "compute", "send")``; afd-mrv2's MRV2 micro-batch runner
    (``afd.ubatch``, the Attention role inside vLLM) asks once per engine for
    ``("compute", "comm")``: the streams its micro-batch threads hand to vLLM's
    ``UBatchContext`` (compute: where each micro-batch's model work runs; comm: what
    vLLM's ``dbo_*switch*`` hand-offs switch to).  Several roles may map to the same
    stream: the serialized fallback maps all of them to one.

    Which streams reach the micro-batch path, per platform: on CUDA and Ascend the
    accelerator backend's ``torch.Stream`` s (NPU through torch_npu's subclass).  On
    CPU (the host backend) a stream has no native object, so the micro-batches get
    the caller's current stream for both roles; inside a vLLM CPU worker that is
    vLLM's own placeholder (its CPU worker swaps torch's stream and event types for
    no-op placeholders, per thread), so only plain ``dbo_yield`` hand-offs apply
    there and the streams returned here order nothing on CPU.

    Streams must come from ``backend`` (``backend.new_stream(name)`` or
    ``backend.current_stream(name)``), never from ``torch.cuda`` / ``torch.npu``
    directly, so the same implementation works on every device and on CPUs.

    This is a ``firstresult`` hook.  afd-mrv2's default implementation runs last:
    multistream disabled -> one stream for every role; enabled -> compute on the
    current stream, each phase listed in ``multistream.phases`` on its own stream,
    the others sharing compute, and every other role on its own stream.  A
    connector overrides it (return a dict) only when its operators demand a
    particular stream layout; return None to defer.

    :param backend: the stream/event backend of this executor.
    :param roles: the stream roles needed, in the caller's order.
    :param config: the parsed ``afd.multistream`` section.
    :return: a dict with exactly the keys in ``roles``, or None.
    """


# ---------------------------------------------------------------- per work item, in this order


@hookspec
def on_recv(work: Work, stream: Stream) -> None:
    """Receive the inputs of ``work.item`` into ``work.inputs``.

    Called once per work item, first of its three phases, on the recv stream
    (see "Threads and the current stream" above).  When it is called, the input
    slot's previous item has finished its compute: ``work.inputs.state`` may be
    overwritten.

    May touch: ``work.inputs.state`` (allocate the receive buffers once, on first
    use, and reuse them), ``work.transfer``, its own communicator.  Must not:
    write ``work.outputs`` (the output slot's previous item may still be sending
    from it), create streams or events, synchronize the device, touch other
    slots, or keep references to ``work`` beyond the item's ``on_send``.

    Raise to fail the pipeline; the executor stops new work, calls ``on_cleanup``
    for every in-flight item and re-raises with the item's identity.

    :param work: the work item, its input and output slots, cancellation and transfer state.
    :param stream: the stream to enqueue on (already current).
    """


@hookspec
def on_compute(work: Work, stream: Stream, compute: ComputeFn) -> None:
    """Run the owner's ``compute`` on ``work.inputs`` and store the result in ``work.outputs``.

    Called once per work item after its recv completed and after the output
    slot's previous item finished its send (event edges on device streams), on
    the compute stream.  The connector adapts its transfer state to
    ``compute``'s signature (for example hands it the received dynamic scales)
    and writes the outputs into ``work.outputs.state`` for ``on_send``.  Once it
    returns, the input slot may be refilled: copy anything of the inputs that
    ``on_send`` still needs into the outputs or ``work.transfer``.

    May touch: ``work.inputs.state`` (read), ``work.outputs.state``,
    ``work.transfer``.  Must not: communicate, create streams or events,
    synchronize the device.

    :param work: as for ``on_recv``.
    :param stream: the compute stream (already current).
    :param compute: the executor owner's compute function (see ``ComputeFn``).
    """


@hookspec
def on_send(work: Work, stream: Stream) -> None:
    """Send the outputs of ``work.item`` from ``work.outputs``.

    Called once per work item after its compute completed, on the send stream.
    When the send stream passes the end of this call the output slot is
    released: the next item bound to it may overwrite it, and the item's
    transfer state is dropped.  A transfer that is still in flight after the hook
    returns must therefore be complete by then on this stream (wait for the
    communicator's work object here).

    May touch: ``work.outputs.state`` (read), ``work.transfer``, its own
    communicator.  Must not read ``work.inputs`` (the next item may be filling
    it already) or keep references to ``work`` after returning.  On
    accelerators, an output that ``on_compute`` allocated (rather than wrote into
    a preallocated output buffer) is read here on another stream: call
    ``tensor.record_stream(stream.native)`` before using it.

    :param work: as for ``on_recv``.
    :param stream: the send stream (already current).
    """


# ---------------------------------------------------------------- tear-down: failure or close


@hookspec
def on_cleanup(work: Work, error: BaseException) -> None:
    """Release what an abandoned work item holds.

    Called exactly once for every work item that was in flight (issued, and its
    ``on_send`` had not returned) when the executor failed or was closed past its
    deadline; never for items whose ``on_send`` returned.  Runs on the thread that
    called ``submit``/``drain``/``close``, after the streams were stopped or
    abandoned, in issue order.

    A phase hook of the same item may still be blocked on an abandoned stream
    thread (host backend) while this runs: do not wait for it; cancel what can be
    cancelled (a pending receive, an operator handle) and drop references.  Must
    not raise; an exception here is logged and swallowed so every item is cleaned.

    :param work: the abandoned item and its slot.
    :param error: why: the phase's exception, or a
        :class:`~afd_mrv2.errors.PipelineAborted` for work abandoned at close.
    """
