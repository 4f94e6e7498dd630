"""The Attention-side runner composed over stand-ins with the exact upstream signatures."""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap
import threading
import types
from pathlib import Path

import pytest
import torch

from afd_mrv2.compat import CompatRefused, Runtime, decide
from afd_mrv2.errors import ConfigError, PluginError
from afd_mrv2.mrv2 import runner as runner_module
from afd_mrv2.mrv2.runner import attention_runner_class
from afd_mrv2.mrv2.worker import afd_worker_class
from afd_mrv2.testing.happens_before import check_happens_before
from tests import standins
from tests.fakedist import make_site
from tests.mrv2.helpers import ASCEND, CUDA, ToyModel, accept_0_33, afd_section, expected
from tests.standins.vllm.config import VllmConfig
from tests.standins.vllm.v1.worker.gpu import ubatch_utils
from tests.standins.vllm.v1.worker.gpu.model_runner import InputBatch
from tests.standins.vllm.v1.worker.gpu_worker import Worker

LAYERS = 3


def _runner_class(upstream=CUDA):
    base = attention_runner_class(upstream, gate=accept_0_33)

    class TestRunner(base):  # our subclass of our class: the FFN result is simulated as 2x + layer
        def afd_compute(self, item, inputs):
            return inputs * 2.0 + item.layer_idx

    return TestRunner


def _build(afd=None, upstream=CUDA, *, init_args=()):
    config = VllmConfig(additional_config={} if afd is None else {"afd": afd})
    runner = _runner_class(upstream)(config, torch.device("cpu"))
    model = ToyModel(LAYERS)
    runner.load_model(model=model)
    runner.initialize_kv_cache({"kv": "cache"}, *init_args)
    if runner.afd is not None:
        model.exchange = runner.afd.exchange
    return runner


def _step(runner, tokens=8):
    input_ids = torch.arange(tokens * 4, dtype=torch.float32).reshape(tokens, 4)
    out = runner.execute_model(InputBatch(tokens), {"input_ids": input_ids})
    assert torch.equal(out, expected(input_ids, LAYERS))
    return out


def test_wrapped_runner_streams_come_from_create_streams() -> None:
    runner = _build(afd_section())
    wrapped = runner.ubatch_runner
    assert isinstance(wrapped, ubatch_utils.UBatchRunner) and type(wrapped).__name__ == "AfdUBatchRunner"
    streams = runner.afd.ubatch_streams
    assert wrapped.comm_stream is streams["comm"] and wrapped.capture_stream is streams["capture"]
    assert (streams["comm"].name, streams["capture"].name) == ("comm", "capture")  # the default hook's layout
    # upstream's constructor still made its two hard-coded streams; they were kept aside, unused
    assert set(wrapped.upstream_streams) == {"comm", "capture"}
    assert all(s[0] == "upstream-cuda-stream" for s in wrapped.upstream_streams.values())
    _step(runner)
    (contexts,) = wrapped.contexts_seen
    assert all(c.comm_stream is streams["comm"] for c in contexts)
    runner.afd_close()


def test_a_create_streams_plugin_decides_the_ubatch_streams(tmp_path: Path, monkeypatch) -> None:
    """A third-party create_streams implementation (entry point in a fake dist) supplies the comm/capture streams."""
    site = make_site(tmp_path, {"afd-stream-spy": "1.0"})
    (site / "afd_stream_spy.py").write_text(
        textwrap.dedent("""
        from afd_mrv2 import hookimpl

        class StreamSpy:
            calls = []

            def __init__(self, context):
                pass

            @hookimpl
            def create_streams(self, backend, roles, config):
                StreamSpy.calls.append(roles)
                if roles != ("comm", "capture"):
                    return None
                return {"comm": backend.new_stream("spy-comm"), "capture": backend.new_stream("spy-capture")}
    """)
    )
    (site / "afd_stream_spy-1.0.dist-info" / "entry_points.txt").write_text(
        "[afd_mrv2]\nstream_spy = afd_stream_spy:StreamSpy\n"
    )
    monkeypatch.syspath_prepend(str(site))
    runner = _build(afd_section(observers=["stream_spy"]))
    spy = sys.modules["afd_stream_spy"].StreamSpy
    assert spy.calls == [("recv", "compute", "send"), ("comm", "capture")]
    assert runner.ubatch_runner.comm_stream.name == "spy-comm"
    assert runner.ubatch_runner.capture_stream.name == "spy-capture"
    _step(runner)
    runner.afd_close()


def test_per_ubatch_communication_phases_run_through_the_executor() -> None:
    runner = _build(afd_section())
    _step(runner)
    _step(runner)
    log = runner.afd.backend.log
    submits = [op for op in log if op.kind == "submit"]
    # microbatches alternate at every layer: u0 l0, u1 l0, u0 l1, ...; per step 3 layers x 2 microbatches
    order = [(i.layer_idx, i.stage_idx) for i in runner.afd.exchange.items]
    assert order == [(layer, ub) for layer in range(LAYERS) for ub in (0, 1)] * 2
    # each item carries its step's stage count (the micro-batch count), which torch_p2p puts on the wire
    assert {i.num_stages for i in runner.afd.exchange.items} == {2}
    assert len(submits) == 3 * len(order)
    for k, item in enumerate(runner.afd.exchange.items):
        ops = submits[3 * k : 3 * k + 3]
        assert [(op.name, op.stream, op.item) for op in ops] == [
            ("recv", "recv", item),
            ("compute", "compute", item),
            ("send", "send", item),
        ]
    check_happens_before(log)
    check_happens_before(log, host_edges=False)
    assert runner.afd_close().clean


def test_multistream_off_for_attention_puts_both_ubatch_roles_on_the_current_stream() -> None:
    runner = _build(afd_section(multistream_roles=("ffn",)))
    streams = runner.afd.ubatch_streams
    assert streams["comm"] is streams["capture"] is runner.afd.executor.streams["compute"]
    assert streams["comm"].name == "serial"
    _step(runner)
    runner.afd_close()


def test_host_backend_runs_the_same_composition() -> None:
    runner = _build(afd_section(backend="host"), init_args=(True, None))  # vLLM 0.33's is_profiling, allocation ctx
    before = threading.active_count()
    _step(runner)
    exchange = runner.afd.exchange
    assert exchange.capacity == 4 and exchange.in_flight == []  # depth 2: 2 input + 2 output buffers
    assert runner.afd_close(2.0).clean
    assert threading.active_count() <= before


def test_ascend_platform_runner_is_extended_the_same_way() -> None:
    runner = _build(afd_section(), upstream=ASCEND)
    assert issubclass(type(runner), ASCEND.platform_runner) and not issubclass(type(runner), type(None))
    assert type(runner).__mro__[1].__name__ == "AfdAttentionNPUModelRunner"
    assert type(runner.ubatch_runner).__name__ == "AfdUBatchRunner"
    _step(runner)
    runner.afd_close()


def test_no_afd_section_leaves_upstream_untouched() -> None:
    runner = _build(None)
    assert runner.afd is None and type(runner.ubatch_runner) is ubatch_utils.UBatchRunner


@pytest.mark.parametrize(
    ("afd", "error", "fragment"),
    [
        ({"connector": "simlink", "role": "decoder"}, ConfigError, "afd.role: expected one of attention, ffn"),
        (
            {"connector": "simlink", "role": "attention", "multistream": {"depth": 0}},
            ConfigError,
            "afd.multistream.depth",
        ),
        ({"connector": "nccl_magic", "role": "attention"}, PluginError, r"installed connectors: .*simlink"),
        ({"connector": "simlink", "role": "ffn"}, ConfigError, "afd.role: the Attention runner serves role attention"),
    ],
)
def test_bad_config_raises_before_any_upstream_code_runs(afd, error, fragment) -> None:
    standins.EVENTS.clear()
    with pytest.raises(error, match=fragment):
        _runner_class()(VllmConfig(additional_config={"afd": afd}), torch.device("cpu"))
    assert standins.EVENTS == []


def test_refused_runtime_raises_before_any_upstream_code_runs() -> None:
    standins.EVENTS.clear()
    unknown = Runtime(python="3.11.9", vllm="0.31.0", vllm_ascend=None, torch="2.13.0", torch_npu=None, cann=None)
    refuse = attention_runner_class(CUDA, gate=lambda caps: decide(unknown, require=caps, env={}))
    with pytest.raises(CompatRefused, match=r"unknown pair: vLLM 0\.31\.0"):
        refuse(VllmConfig(additional_config={"afd": afd_section()}), torch.device("cpu"))
    assert standins.EVENTS == []


def test_worker_builds_the_attention_runner_only_for_afd() -> None:
    worker_cls = afd_worker_class(Worker, CUDA, gate=accept_0_33)
    with_afd = worker_cls(VllmConfig(additional_config={"afd": afd_section()}), torch.device("cpu"))
    assert isinstance(with_afd.model_runner, runner_module.AfdAttentionRunnerMixin)
    plain = worker_cls(VllmConfig(), torch.device("cpu"))
    assert type(plain.model_runner).__name__ == "GPUModelRunner"


def _standin_namespaces() -> list[object]:
    found = []
    for name, module in sorted(sys.modules.items()):
        if name == "tests.standins" or name.startswith("tests.standins."):
            found.append(module)
            found += [v for v in vars(module).values() if inspect.isclass(v) and v.__module__ == name]
    return found


def test_no_attribute_of_an_upstream_stand_in_class_or_module_is_assigned() -> None:
    namespaces = _standin_namespaces()
    assert len(namespaces) > 15
    before = [(ns, dict(vars(ns))) for ns in namespaces]
    runner = _build(afd_section())
    _step(runner)
    runner.afd_close()
    afd_worker_class(Worker, CUDA, gate=accept_0_33)(VllmConfig(additional_config={"afd": afd_section()}), "cpu")
    for ns, snapshot in before:
        now = dict(vars(ns))
        changed = sorted(k for k in snapshot.keys() | now.keys() if snapshot.get(k, ...) is not now.get(k, ...))
        assert changed == [], f"{ns!r}: attributes assigned: {changed}"


def test_composition_source_assigns_only_to_self() -> None:
    """Static guard over afd_mrv2/mrv2 and the plugin: no setattr, no attribute assignment except on self."""
    root = Path(runner_module.__file__).parent
    files = [*sorted(root.glob("*.py")), root.parent / "vllm_plugin.py"]
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
                for t in ast.walk(target):
                    if isinstance(t, ast.Attribute) and not (isinstance(t.value, ast.Name) and t.value.id == "self"):
                        offences.append(f"{path.name}:{t.lineno} assigns {ast.unparse(t)}")
    assert offences == []
    assert isinstance(runner_module, types.ModuleType)
