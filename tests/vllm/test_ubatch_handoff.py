"""afd-mrv2's micro-batch runner with vLLM's real hand-off, in this process (no engine).

The launcher of :mod:`afd_mrv2.mrv2.attention.ubatch_runner` over vLLM 0.32's own ``UBatchRunner``
base class, ``make_ubatch_contexts``, ``UBatchContext`` (two events per micro-batch, no
timeout), ``dbo_yield`` / ``dbo_enabled`` / ``dbo_current_ubatch_id``, ``slice_model_inputs``
and ``merge_ubatch_outputs``, in the environment of a vLLM CPU worker (its module swaps
torch's stream and event types for placeholders, as a worker process has them).  The toy
model's MoE layers make real round trips over gloo to a real ``serve_ffn`` thread
(tests/mrv2/helpers.py).  What the engine tests cannot show: after a micro-batch fails (an
exception injected in one micro-batch's layer) the step ends with an error naming it, no
thread stays parked, vLLM's process-wide micro-batch registry is empty again
(``dbo_enabled()`` is False), and the next unsplit step is labelled stage count 1 and is
served by the same FFN session.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.vllm_runtime, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def real() -> SimpleNamespace:
    import vllm.v1.worker.cpu_worker  # noqa: F401 - a CPU worker's environment: vLLM's stream placeholders
    from vllm import forward_context
    from vllm.v1.worker import ubatching
    from vllm.v1.worker.gpu.ubatch_utils import UBatchState
    from vllm.v1.worker.ubatch_utils import UBatchSlice

    from afd_mrv2.mrv2.upstream import load_handoff, load_ubatch_api

    return SimpleNamespace(
        api=load_ubatch_api(),
        handoff=load_handoff(),
        ubatching=ubatching,
        forward_context=forward_context,
        UBatchState=UBatchState,
        UBatchSlice=UBatchSlice,
    )


def _runner(real: SimpleNamespace) -> Any:
    from afd_mrv2.devices import make_backend
    from afd_mrv2.mrv2.attention.ubatch_runner import afd_ubatch_runner_class

    backend = make_backend("host")
    stream = backend.new_stream("serial")
    config = SimpleNamespace(parallel_config=SimpleNamespace(cp_kv_cache_interleave_size=1))
    cls = afd_ubatch_runner_class(real.api)
    return cls(
        config,
        torch.device("cpu"),
        None,
        [],
        None,
        8,
        num_ubatches=2,
        backend=backend,
        streams={"compute": stream, "comm": stream},
    )


def _state(real: SimpleNamespace, tokens: int) -> Any:
    half = tokens // 2
    slices = [
        real.UBatchSlice(slice(0, half), slice(0, half)),
        real.UBatchSlice(slice(half, tokens), slice(half, tokens)),
    ]
    return real.UBatchState(slices=slices, forward_contexts=[("forward context", 0), ("forward context", 1)])


def _inputs(tokens: int, seed: int = 0) -> dict[str, torch.Tensor]:
    from tests.mrv2.helpers import VOCAB

    ids = torch.randint(0, VOCAB, (tokens,), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "positions": torch.arange(tokens)}


def _split(runner: Any, model: Any, real: SimpleNamespace, tokens: int, seed: int = 0) -> torch.Tensor:
    box: dict[str, Any] = {}

    def go() -> None:
        try:
            box["out"] = runner.run(model, _inputs(tokens, seed), _state(real, tokens))
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            box["error"] = exc

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "the split step hangs"
    if "error" in box:
        raise box["error"]
    return box["out"]


def _parked() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("afd-ubatch")]


def test_with_vllms_hand_off_a_failed_micro_batch_releases_its_sibling_and_the_next_step_is_unsplit(
    real: SimpleNamespace, one_torch_thread: None
) -> None:
    from afd_mrv2.mrv2.attention.handoff import MicroBatchFailed
    from tests.mrv2.helpers import FfnPair, ToyMoeModel

    pair = FfnPair(handoff=real.handoff)
    model = ToyMoeModel(
        pair.remote,
        ubatch_id=real.ubatching.dbo_current_ubatch_id,
        get_context=lambda: real.forward_context._forward_context,
    )
    runner = _runner(real)
    try:
        inputs = _inputs(8)
        out = _split(runner, model, real, 8)
        torch.testing.assert_close(out, model.reference(inputs["input_ids"]), rtol=1e-5, atol=1e-5)
        assert model.contexts == [("forward context", 0), ("forward context", 1)]  # each thread its own context
        assert not real.ubatching.dbo_enabled()

        model.fail_at = (1, 1)  # micro-batch 1's second MoE layer raises; micro-batch 0 is parked in dbo_yield
        started = time.monotonic()
        with pytest.raises(MicroBatchFailed) as info:
            _split(runner, model, real, 8, seed=1)
        took = time.monotonic() - started
        assert str(info.value) == "micro-batch 1 of 2 failed: RuntimeError: injected failure in layer 1"
        assert took < 10 and _parked() == [] and not runner.ready_barrier.broken
        assert not real.ubatching.dbo_enabled() and real.ubatching._THREAD_ID_TO_CONTEXT == {}

        model.fail_at = None
        again = _inputs(3, seed=2)
        unsplit = model(**again)  # the next step runs unsplit: stage 0 of 1, served by the same FFN session
        torch.testing.assert_close(unsplit, model.reference(again["input_ids"]), rtol=1e-5, atol=1e-5)
        last = list(pair.remote._session.exchange.items)[-2:]  # type: ignore[union-attr]
        assert [(i.layer_idx, i.stage_idx, i.num_stages) for i in last] == [(0, 0, 1), (1, 0, 1)]
        print(f"\n[real hand-off] failed step ended in {took:.2f} s: {info.value}", flush=True)
    finally:
        runner.afd_backend.close(time.monotonic() + 5)
        done = pair.close()
    assert "error" not in done, done
    assert dict(done["report"].items_by_stage_count)[1] == 2
