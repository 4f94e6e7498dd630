"""Test doubles of the Ascend CAM operators (pure torch, CPU).  Test code only.

Nothing in afd-mrv2 selects these by default: a connector uses them only when
the embedding code passes an :class:`~afd_mrv2.hooks.cam.ops.OpSet` built here
as the runtime resource ``cam_test_ops`` (the explicit test switch, see
:mod:`afd_mrv2.hooks.cam.common`).  Resources come from code, never from the
``afd`` configuration, so a deployment cannot pick a double by mistake.

* :mod:`cam_fabric`: the transport underneath (in-process mailboxes between the
  attention and FFN ranks, optional delivery delays that make later transfers
  overtake earlier ones) and the worker thread a stream-ignoring double runs on;
* :mod:`camp2p_doubles`: ``afd_ascend.a2e`` / ``e2a``;
* :mod:`camasync_doubles`: ``umdk_cam_op_lib.async_dispatch_send/recv``,
  ``async_combine_send/recv``;
* :mod:`probe_doubles`: the start-up stream probe run against the doubles,
  producing the same evidence ``afd-mrv2 probe npu`` writes on hardware.
"""
