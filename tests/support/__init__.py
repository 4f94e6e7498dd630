"""Test support for afd-mrv2's tests: doubles and oracles that are not product code.

It lives with the tests, outside the ``afd_mrv2`` package, and nothing in the product imports it:
no module of ``afd_mrv2`` imports ``tests`` or
``tests.support``, not even lazily inside a function (checked by
``tests/test_no_test_support_in_product.py`` and by an import-linter contract).  What the product itself runs is product code
and lives with it (e.g. the no-op connector ``afd-mrv2 bench`` measures with is
:mod:`afd_mrv2.bench.noop`).

What it holds:

* the CAM doubles, test doubles of the Ascend CAM operators (pure torch, CPU):

  - :mod:`tests.support.doubles_base`: what every double shares (running an
    effect on or off the caller's stream, each operator's argument list declared once,
    the double's ``OpSet``);
  - :mod:`tests.support.camp2p_doubles`: ``afd_ascend.a2e`` / ``e2a``;
  - :mod:`tests.support.camasync_doubles`:
    ``umdk_cam_op_lib.async_dispatch_send/recv``, ``async_combine_send/recv``;

* the fabric, :mod:`tests.support.cam_fabric`: the transport under the
  doubles (in-process mailboxes between the attention and FFN ranks, optional
  delivery delays that make later transfers overtake earlier ones) and the worker
  thread a stream-ignoring double runs on;
* the happens-before oracle, :mod:`tests.support.happens_before`: replays a
  recording-backend op log with device-stream semantics and proves the
  executor's edges;
* the probe doubles, :mod:`tests.support.probe_doubles`: the start-up stream
  probe run against the doubles, producing the same evidence ``afd-mrv2 probe
  npu`` writes on hardware.

Nothing in afd-mrv2 selects a double by default: a connector uses them only when
the embedding code passes an :class:`~afd_mrv2.hooks.cam.ops.OpSet` built here as
the runtime resource ``cam_ops`` (passed in by the code that builds the connector, see
:mod:`afd_mrv2.hooks.cam.common`).  Resources come from code, never from the
``afd`` configuration, so a deployment cannot pick a double by mistake.
"""
