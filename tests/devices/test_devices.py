"""Stream/event semantics of the host backend (device-stream semantics on threads)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from afd_mrv2.devices import HostBackend, make_backend
from afd_mrv2.devices.base import Span
from afd_mrv2.devices.host import current_host_stream
from afd_mrv2.errors import PipelineAborted


@pytest.fixture
def backend():
    backend = HostBackend()
    yield backend
    backend.abort()
    backend.close(time.monotonic() + 1)


def test_stream_runs_its_queue_in_fifo_order_on_its_own_thread(backend: HostBackend) -> None:
    stream = backend.new_stream("s")
    seen: list[tuple[int, str]] = []
    for i in range(50):
        stream.submit(lambda i=i: seen.append((i, current_host_stream().name)))
    done = backend.new_event()
    stream.record(done)
    assert done.synchronize(timeout=2)
    assert seen == [(i, "s") for i in range(50)]


def test_wait_binds_to_the_record_that_was_latest_at_wait_time(backend: HostBackend) -> None:
    a, b = backend.new_stream("a"), backend.new_stream("b")
    event = backend.new_event()
    gate1, gate2 = threading.Event(), threading.Event()
    ran_b = threading.Event()
    a.submit(gate1.wait)
    a.record(event)  # generation 1
    b.wait(event)  # bound to generation 1
    b.submit(ran_b.set)
    a.submit(gate2.wait)
    a.record(event)  # generation 2, not needed by b
    assert not ran_b.wait(0.1)  # b waits for generation 1
    assert not event.query()
    gate1.set()
    assert ran_b.wait(2)  # generation 1 suffices although generation 2 is pending
    assert not event.query()  # query reflects the most recent record
    gate2.set()
    assert event.synchronize(timeout=2) and event.query()


def test_waiting_on_a_never_recorded_event_is_a_no_op(backend: HostBackend) -> None:
    stream = backend.new_stream("s")
    event = backend.new_event()
    assert event.query() and event.synchronize(timeout=0)
    ran = threading.Event()
    stream.wait(event)
    stream.submit(ran.set)
    assert ran.wait(2)


def test_synchronize_times_out_and_abort_wakes_every_waiter(backend: HostBackend) -> None:
    a, b = backend.new_stream("a"), backend.new_stream("b")
    gate = threading.Event()
    event = backend.new_event()
    a.submit(gate.wait)
    a.record(event)
    b.wait(event)
    after = threading.Event()
    b.submit(after.set)
    assert event.synchronize(timeout=0.05) is False
    errors: list[BaseException] = []

    def host_wait() -> None:
        try:
            event.synchronize()
        except PipelineAborted as exc:
            errors.append(exc)

    waiter = threading.Thread(target=host_wait)
    waiter.start()
    backend.abort()
    waiter.join(2)
    assert not waiter.is_alive() and len(errors) == 1
    gate.set()
    report = backend.close(time.monotonic() + 1)
    assert report.clean
    assert not after.is_set()  # work queued behind the wait was dropped, not run


def test_close_abandons_a_thread_stuck_in_work_and_says_what_it_was_doing(backend: HostBackend) -> None:
    stuck = backend.new_stream("recv")
    never = threading.Event()
    stuck.submit(never.wait, Span("recv", "recv", stuck.stream_id, None, None))
    time.sleep(0.05)
    start = time.monotonic()
    report = backend.close(time.monotonic() + 0.2)
    assert time.monotonic() - start < 0.2 + 1.0  # the deadline, not the stuck work (never), give or take load
    assert report.abandoned_streams == {"recv": "recv"}
    never.set()


def test_an_exception_escaping_submitted_work_aborts_the_backend(backend: HostBackend) -> None:
    stream = backend.new_stream("s")
    stream.submit(lambda: 1 / 0)
    deadline = time.monotonic() + 2
    while not backend.aborted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert backend.aborted and isinstance(backend.errors[0][1], ZeroDivisionError)


def test_host_spans_are_timed_on_the_stream_thread(backend: HostBackend) -> None:
    stream = backend.new_stream("s")
    span = Span("compute", "s", stream.stream_id, None, (0, 0))
    stream.submit(lambda: time.sleep(0.02), span)
    event = backend.new_event()
    stream.record(event)
    event.synchronize(timeout=2)
    assert 0.015e9 < span.duration_ns < 1e9


def test_make_backend_names() -> None:
    assert make_backend("host").name == "host"
    assert make_backend("recording").name == "recording"
    assert make_backend("inline").name == "inline"
    with pytest.raises(ValueError, match="accepted: auto, accelerator, host, inline, recording"):
        make_backend("cuda")
    if torch.accelerator.is_available():
        assert make_backend("auto").name == "accelerator"
    else:
        assert make_backend("auto").name == "host"
        with pytest.raises(RuntimeError, match="none is available: use backend 'host'"):
            make_backend("accelerator")
