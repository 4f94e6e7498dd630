"""The Attention runner and afd-mrv2's micro-batch runner, composed over stand-ins with upstream's shapes.

The stand-ins (tests/standins) behave like vLLM 0.32/0.33 where it matters here:
upstream's ``UBatchRunner.__init__`` fails without CUDA, its forward contexts assert
DP > 1, one metadata builder per group asserts for micro-batch 1, the hand-off is
upstream's two-event protocol with no timeout.  The toy model's MoE layers make real
round trips over gloo to a real ``serve_ffn`` thread (tests/mrv2/helpers.py).
"""

from __future__ import annotations

import ast
import inspect
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from afd_mrv2.api import supports_in_flight
from afd_mrv2.compat import CompatRefused, Runtime, decide
from afd_mrv2.errors import ConfigError, PluginError
from afd_mrv2.hooks.p2p.torch_p2p import TorchP2pConnector
from afd_mrv2.mrv2.attention import runner as runner_module
from afd_mrv2.mrv2.attention.handoff import MicroBatchFailed, current_step
from afd_mrv2.mrv2.attention.runner import AfdAttentionRunnerMixin, attention_runner_class
from afd_mrv2.mrv2.attention.ubatch_runner import AfdUBatchRunnerMixin
from afd_mrv2.mrv2.attention.worker import afd_worker_class
from afd_mrv2.plugins import ConnectorContext
from tests import standins
from tests.connectors import install_entry_point
from tests.mrv2.helpers import ASCEND, CUDA, VOCAB, FfnPair, ToyMoeModel, accept_0_33, attention_afd
from tests.standins.vllm.config import VllmConfig
from tests.standins.vllm.v1.worker import ubatching
from tests.standins.vllm.v1.worker.gpu.cudagraph_utils import ModelCudaGraphManager
from tests.standins.vllm.v1.worker.gpu.model_runner import GPUModelRunner, StepInput
from tests.standins.vllm.v1.worker.gpu_worker import Worker

STEP_TIMEOUT_S = 60.0


def _runner_class(upstream=CUDA, remote=None):
    base = attention_runner_class(upstream, gate=accept_0_33)

    class TestRunner(base):  # the process's MoE-seam session is this test's
        def _afd_attached(self):
            return remote

    return TestRunner


def _build(pair: FfnPair | None, *, upstream=CUDA, compute_s: float = 0.0, init_args=()):
    afd = {} if pair is None else {"afd": pair.section}
    runner = _runner_class(upstream, None if pair is None else pair.remote)(
        VllmConfig(additional_config=afd), torch.device("cpu")
    )
    model = ToyMoeModel(pair.remote if pair is not None else None, compute_s=compute_s)  # type: ignore[arg-type]
    runner.load_model(model=model)
    runner.initialize_kv_cache({"kv": "cache"}, *init_args)
    return runner, model


def _decode(tokens: int, seed: int = 0) -> StepInput:
    return StepInput.decode(torch.randint(0, VOCAB, (tokens,), generator=torch.Generator().manual_seed(seed)))


def _mixed(prompt: int, decodes: int, seed: int = 1) -> StepInput:
    ids = torch.randint(0, VOCAB, (prompt + decodes,), generator=torch.Generator().manual_seed(seed))
    return StepInput(ids, [prompt] + [1] * decodes, [True] + [False] * decodes)


def _run(runner, step: StepInput, **kwargs: Any) -> torch.Tensor:
    """One step on a watchdog: a hung step fails the test instead of hanging it."""
    box: dict[str, Any] = {}

    def go() -> None:
        try:
            runner.execute_model(step, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            box["error"] = exc

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    thread.join(STEP_TIMEOUT_S)
    assert not thread.is_alive(), f"the step did not end within {STEP_TIMEOUT_S} s"
    if "error" in box:
        raise box["error"]
    return runner.execute_model_state.hidden_states


def _no_ubatch_threads() -> bool:
    return not [t for t in threading.enumerate() if t.name.startswith("afd-ubatch")]


def test_split_and_unsplit_steps_equal_the_reference_and_carry_their_stage_identity(one_torch_thread: None) -> None:
    pair = FfnPair()
    runner, model = _build(pair)
    try:
        steps = [_decode(8), _decode(1), _mixed(5, 4), _decode(3, seed=2)]
        for step in steps:
            out = _run(runner, step)
            torch.testing.assert_close(out, model.reference(step.input_ids), rtol=1e-5, atol=1e-5)
        items = list(pair.remote._session.exchange.items)  # type: ignore[union-attr]
    finally:
        done = pair.close()
    assert "error" not in done, done
    # one token is below the thresholds (2): that step runs unsplit, the others in two micro-batches
    stages = [(i.layer_idx, i.stage_idx, i.num_stages) for i in items]
    split = [(layer, ub, 2) for layer in (0, 1) for ub in (0, 1)]
    assert stages == [*split, (0, 0, 1), (1, 0, 1), *split, *split]
    assert dict(done["report"].items_by_stage_count) == {2: 12, 1: 2} == dict(pair.remote.items_by_stage_count)
    stats = runner.afd_runner_stats()
    assert stats["num_ubatches"] == 2 and stats["split_steps"] == 3
    assert stats["steps"] == {"decode": {"1": 1, "2": 2}, "mixed": {"2": 1}}
    assert _no_ubatch_threads() and not ubatching.dbo_enabled() and current_step() is None


def test_the_micro_batch_runner_is_afd_mrv2_s_own_at_dp_1(one_torch_thread: None) -> None:
    """Upstream's constructor (SM control, CUDA streams) never runs; builders per micro-batch; DP-free contexts."""
    standins.EVENTS.clear()
    pair = FfnPair()
    runner, model = _build(pair)
    try:
        ubatch = runner.ubatch_runner
        assert isinstance(ubatch, AfdUBatchRunnerMixin) and type(ubatch).__name__ == "AfdUBatchRunner"
        assert "UBatchRunner.__init__" not in standins.EVENTS
        assert ubatch.num_ubatches == 2 and runner.vllm_config.parallel_config.num_ubatches == 0  # no DBO flags
        assert [len(g.metadata_builders) for groups in runner.attn_groups for g in groups] == [2]
        manager = runner.cudagraph_manager
        assert isinstance(manager, ModelCudaGraphManager) and type(manager).__name__ == "AfdModelCudaGraphManager"
        assert manager.ubatch_runner is ubatch
        model.contexts.clear()
        _run(runner, _decode(6))
        # each micro-batch ran under its own forward context: its own builder, its own tokens, no DP metadata
        built = [next(iter(c["attn_metadata"].values())) for c in model.contexts]
        assert built == [{"builder": 0, "num_tokens": 3}, {"builder": 1, "num_tokens": 3}]
        assert all(c["dp_metadata"] is None for c in model.contexts)
    finally:
        pair.close()


def test_dummy_runs_and_steps_below_the_thresholds_stay_unsplit(one_torch_thread: None) -> None:
    pair = FfnPair(threshold=4)
    runner, _ = _build(pair)
    try:
        _run(runner, _decode(8), dummy_run=True)
        _run(runner, _decode(3))
        _run(runner, _decode(4))
    finally:
        pair.close()
    assert runner.afd_runner_stats()["steps"] == {"decode": {"1": 1, "2": 1}, "dummy": {"1": 1}}


def test_the_sibling_computes_while_a_round_trip_is_in_flight(one_torch_thread: None) -> None:
    """Measured on the seam's own spans (not wall-clock thresholds): with 20 ms of attention per layer and
    40 ms of FFN per item, micro-batch 1's first attention runs inside micro-batch 0's first round trip, and
    so does micro-batch 0's second attention inside micro-batch 1's first round trip."""
    pair = FfnPair(ffn_delay_s=0.04)
    runner, _ = _build(pair, compute_s=0.02)
    meter = pair.remote.meter
    steps: list[tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]] = []
    fold = meter.end_step

    def keep_spans(num_stages: int) -> None:  # the spans the meter folds, kept for the structural check
        steps.append(
            (sorted(meter._step.computes, key=lambda s: s[1]), sorted(meter._step.round_trips, key=lambda s: s[1]))
        )
        fold(num_stages)

    meter.end_step = keep_spans  # type: ignore[method-assign]
    try:
        for seed in range(3):
            _run(runner, _decode(8, seed))
        _run(runner, _decode(1))  # unsplit: nothing to overlap with
    finally:
        pair.close()
    for computes, round_trips in steps[:3]:
        (_, rtt0_start, rtt0_end), (_, rtt1_start, rtt1_end) = round_trips[0], round_trips[1]
        c1 = next(c for c in computes if c[0] == 1)  # micro-batch 1, first layer
        c0 = [c for c in computes if c[0] == 0][1]  # micro-batch 0, second layer
        assert round_trips[0][0] == 0 and round_trips[1][0] == 1
        assert rtt0_start <= c1[1] and c1[2] <= rtt0_end, (computes, round_trips)
        assert rtt1_start <= c0[1] and c0[2] <= rtt1_end, (computes, round_trips)
    overlap = meter.snapshot()
    # of each step's 4 round trips the last has no sibling left to hide under (at most 3/4 hidden), and a
    # hidden one is covered by one 20 ms attention out of its 40+ ms: about 1/4 in all
    assert overlap["2"]["round_trips"] == 12 and 0.15 <= overlap["2"]["hidden_fraction"] <= 0.75, overlap
    assert overlap["1"]["round_trips"] == 2 and overlap["1"]["hidden_fraction"] == 0.0, overlap


def test_a_failing_micro_batch_ends_the_step_and_releases_its_sibling(one_torch_thread: None) -> None:
    pair = FfnPair()
    runner, model = _build(pair)
    try:
        _run(runner, _decode(8))
        model.fail_at = (1, 1)  # micro-batch 1, second MoE layer (micro-batch 0 is parked in a hand-off)
        started = time.monotonic()
        with pytest.raises(MicroBatchFailed) as info:
            _run(runner, _decode(8))
        assert time.monotonic() - started < 10.0
        assert str(info.value) == "micro-batch 1 of 2 failed: RuntimeError: injected failure in layer 1"
        assert _no_ubatch_threads() and not ubatching.dbo_enabled() and current_step() is None
        assert not runner.ubatch_runner.ready_barrier.broken
        assert pair.remote._session.exchange.in_flight == []  # type: ignore[union-attr]
        model.fail_at = None
        step = _decode(1)
        torch.testing.assert_close(_run(runner, step), model.reference(step.input_ids), rtol=1e-5, atol=1e-5)
        last = list(pair.remote._session.exchange.items)[-2:]  # type: ignore[union-attr]
        assert [(i.layer_idx, i.stage_idx, i.num_stages) for i in last] == [(0, 0, 1), (1, 0, 1)]
    finally:
        done = pair.close()
    assert "error" not in done, done
    assert runner.afd_runner_stats()["failed_steps"] == 1


def test_a_failing_ffn_ends_the_split_step_with_an_error_naming_the_micro_batch(one_torch_thread: None) -> None:
    pair = FfnPair(ffn_fails_after=4)  # the first step's 4 items are served, the next step's first one fails
    runner, _ = _build(pair)
    try:
        _run(runner, _decode(8))
        started = time.monotonic()
        with pytest.raises(MicroBatchFailed, match=r"^micro-batch 0 of 2 failed: PipelineError: ") as info:
            _run(runner, _decode(8))
        assert time.monotonic() - started < 10.0
        assert _no_ubatch_threads() and not ubatching.dbo_enabled() and current_step() is None
        assert "the FFN's experts failed (test)" in str(info.value.cause), info.value.cause
    finally:
        pair.remote.close()
        pair.thread.join(30)


def test_ascend_platform_runner_is_extended_the_same_way(one_torch_thread: None) -> None:
    pair = FfnPair()
    runner, model = _build(pair, upstream=ASCEND)
    try:
        assert type(runner).__mro__[1].__name__ == "AfdAttentionNPUModelRunner"
        assert isinstance(runner.ubatch_runner, AfdUBatchRunnerMixin)
        step = _decode(5)
        torch.testing.assert_close(_run(runner, step), model.reference(step.input_ids), rtol=1e-5, atol=1e-5)
    finally:
        pair.close()


def test_host_backend_and_vllm_033_initialize_kv_cache_arguments(one_torch_thread: None) -> None:
    pair = FfnPair(multistream={"enabled": True, "roles": ["attention"], "backend": "host"})
    runner, _ = _build(pair, init_args=(True, None))  # vLLM 0.33's is_profiling, allocation ctx
    try:
        streams = runner.ubatch_runner.afd_streams
        assert (streams["compute"].name, streams["comm"].name) == ("compute", "comm")
        _run(runner, _decode(4))
    finally:
        pair.close()


def test_no_afd_section_leaves_upstream_untouched() -> None:
    runner, _ = _build(None)
    assert runner.afd_remote is None and runner.ubatch_runner is None
    assert type(runner.cudagraph_manager) is ModelCudaGraphManager


@pytest.mark.parametrize(
    ("afd", "error", "fragment"),
    [
        ({"connector": "torch_p2p", "role": "decoder"}, ConfigError, "afd.role: expected one of attention, ffn"),
        (attention_afd(29500, multistream={"depth": 0}), ConfigError, "afd.multistream.depth"),
        ({"connector": "nccl_magic", "role": "attention"}, PluginError, r"installed connectors: .*torch_p2p"),
        (
            {**attention_afd(29500), "role": "ffn"},
            ConfigError,
            "afd.role: the Attention runner serves role attention",
        ),
        (attention_afd(29500, threshold=1), ConfigError, r"afd\.ubatch\.decode_token_threshold: expected at least"),
        (
            attention_afd(29500, 4, threshold=4, multistream={"depth": 1}),
            ConfigError,
            r"afd\.ubatch\.num_ubatches: 4 micro-batches keep 4 round trips in flight",
        ),
        (
            attention_afd(29500, connector="simlink", connector_extra_config={"latency_us": 0}),
            ConfigError,
            r"connector 'simlink' does not declare carries_stage_identity",
        ),
    ],
)
def test_bad_config_raises_before_any_upstream_code_runs(afd, error, fragment) -> None:
    standins.EVENTS.clear()
    with pytest.raises(error, match=fragment) as info:
        _runner_class()(VllmConfig(additional_config={"afd": afd}), torch.device("cpu"))
    assert standins.EVENTS == [] and "\n" not in str(info.value)


def test_refused_runtime_raises_before_any_upstream_code_runs() -> None:
    standins.EVENTS.clear()
    unknown = Runtime(python="3.11.9", vllm="0.31.0", vllm_ascend=None, torch="2.13.0", torch_npu=None, cann=None)
    refuse = attention_runner_class(CUDA, gate=lambda caps: decide(unknown, require=caps, env={}))
    with pytest.raises(CompatRefused, match=r"unknown pair: vLLM 0\.31\.0"):
        refuse(VllmConfig(additional_config={"afd": attention_afd(29500)}), torch.device("cpu"))
    assert standins.EVENTS == []


def test_worker_builds_the_attention_runner_only_for_afd_under_v2() -> None:
    worker_cls = afd_worker_class(Worker, CUDA, gate=accept_0_33)
    with_afd = worker_cls(VllmConfig(additional_config={"afd": attention_afd(29500)}), torch.device("cpu"))
    assert isinstance(with_afd.model_runner, AfdAttentionRunnerMixin)
    assert type(worker_cls(VllmConfig(), torch.device("cpu")).model_runner) is GPUModelRunner
    v1 = worker_cls(VllmConfig(additional_config={"afd": attention_afd(29500)}, use_v2_model_runner=False), "cpu")
    assert type(v1.model_runner).__name__ == "V1ModelRunner"  # the MoE seam alone carries AFD there


def _standin_namespaces() -> list[object]:
    found = []
    for name, module in sorted(sys.modules.items()):
        if name == "tests.standins" or name.startswith("tests.standins."):
            found.append(module)
            found += [v for v in vars(module).values() if inspect.isclass(v) and v.__module__ == name]
    return found


def test_no_attribute_of_an_upstream_stand_in_class_or_module_is_assigned(one_torch_thread: None) -> None:
    """Module globals that upstream itself mutates at run time (the forward context, the micro-batch
    registry) are excluded: they are upstream's own state, changed by upstream's own functions."""
    namespaces = _standin_namespaces()
    assert len(namespaces) > 15
    before = [(ns, dict(vars(ns))) for ns in namespaces]
    pair = FfnPair()
    runner, _ = _build(pair)
    try:
        _run(runner, _decode(4))
    finally:
        pair.close()
    afd_worker_class(Worker, CUDA, gate=accept_0_33)(VllmConfig(additional_config={"afd": pair.section}), "cpu")
    upstream_state = {"_forward_context", "_LOCAL"}
    for ns, snapshot in before:
        now = dict(vars(ns))
        changed = sorted(
            k
            for k in snapshot.keys() | now.keys()
            if snapshot.get(k, ...) is not now.get(k, ...) and k not in upstream_state
        )
        assert changed == [], f"{ns!r}: attributes assigned: {changed}"


def _assigned(target: ast.expr) -> list[ast.expr]:
    """The expressions an assignment to ``target`` writes through: the target and what its attributes and
    subscripts hang off (``self.a[k].b = v`` writes ``self.a[k].b``, ``self.a[k]`` and ``self.a``), not indices."""
    if isinstance(target, (ast.Tuple, ast.List)):
        return [t for element in target.elts for t in _assigned(element)]
    if isinstance(target, ast.Starred):
        return _assigned(target.value)
    if isinstance(target, (ast.Attribute, ast.Subscript)):
        return [target, *_assigned(target.value)]
    return [target]


def test_composition_source_assigns_only_to_self() -> None:
    """Static guard over afd_mrv2/mrv2 and the plugin: no setattr, no attribute assignment except on self."""
    root = Path(runner_module.__file__).parents[1]  # afd_mrv2/mrv2, every subpackage
    files = [*sorted(root.rglob("*.py")), root.parent / "vllm_plugin.py"]
    # vllm-ascend's per-step forward context is written through its proxy (its __setattr__ is the API,
    # checked as a seam), as its own forward_impl does: a step's state, not a patch of a class or module
    allowed = {"_EXTRA_CTX.moe_comm_method"}
    offences = []
    for path in files:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("setattr", "delattr")
            ):
                offences.append(f"{path.name}:{node.lineno} {node.func.id}")
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, (ast.AnnAssign, ast.AugAssign))
                else []
            )
            for target in targets:
                for t in _assigned(target):
                    if ast.unparse(t) in allowed:
                        continue
                    if isinstance(t, ast.Attribute) and not (isinstance(t.value, ast.Name) and t.value.id == "self"):
                        offences.append(f"{path.name}:{t.lineno} assigns {ast.unparse(t)}")
    assert offences == []
    assert isinstance(runner_module, types.ModuleType)


class SinkWrapping(TorchP2pConnector):
    """A third party's torch_p2p subclass that wraps the owner's ``sink`` with a plain function, written
    against the tensor contract (it reads ``result.shape``): what tests/vllm's drop/swap connectors do."""

    seen: ClassVar[list[type]] = []

    def __init__(self, context: ConnectorContext) -> None:
        resources = dict(context.resources)
        if "sink" in resources:
            owner_sink = resources["sink"]

            def sink(item: Any, result: torch.Tensor) -> None:
                SinkWrapping.seen.append(type(result))
                assert result.shape[0] > 0
                owner_sink(item, result)

            resources["sink"] = sink
        super().__init__(ConnectorContext(config=context.config, resources=resources))


def test_a_third_party_sink_wrapper_keeps_receiving_tensors(
    one_torch_thread: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    install_entry_point(tmp_path, monkeypatch, "afd_sink_wrapping", "sink_wrapping", f"{__name__}:SinkWrapping")
    SinkWrapping.seen.clear()
    pair = FfnPair(connector="sink_wrapping")
    runner, model = _build(pair)
    try:
        for step in [_decode(8), _decode(1), _mixed(5, 4)]:
            torch.testing.assert_close(_run(runner, step), model.reference(step.input_ids), rtol=1e-5, atol=1e-5)
        exchange_sink = pair.remote._session.exchange.resources()["sink"]  # type: ignore[union-attr]
    finally:
        done = pair.close()
    assert "error" not in done, done
    # 2 layers x (2 + 1 + 2) items, every one a tensor: the wrapper never saw a result still in flight
    assert SinkWrapping.seen == [torch.Tensor] * 10
    assert supports_in_flight(exchange_sink)  # afd-mrv2's own sink opts in to in-flight results
