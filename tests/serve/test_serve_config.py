"""Bad input fails before any process starts: one line, exit 2, no child spawned; the plan each role gets."""

from __future__ import annotations

import io
import json
import socket
import subprocess
import sys

import pytest

from afd_mrv2.cli import serve as serve_cli
from afd_mrv2.config import parse_afd_config
from afd_mrv2.errors import AfdError, ConfigError
from afd_mrv2.placement import Placement
from afd_mrv2.ports import ephemeral_ports, ports_in_ephemeral_range
from afd_mrv2.serve import RoleCommands, ServeOptions, attention_command, build_plan, ffn_command
from afd_mrv2.serve import plan as serve_plan
from afd_mrv2.serve import roles as roles_module
from afd_mrv2.serve.plan import RANK_KEY, cpu_binds
from afd_mrv2.serve.supervisor import Supervisor
from tests.serve.conftest import free_port_block

BAD = [
    (["--depth", "0"], "afd.multistream.depth"),
    (["--depth", "9"], "afd.multistream.depth"),
    (["--depth", "deep"], "afd.multistream.depth"),
    (["--afd", '{"multistream": {"depth": 99}}'], "afd.multistream.depth"),
    (["--afd", '{"multistream": {"bogus": 1}}'], "afd.multistream.bogus"),
    (["--afd", '{"no_such_key": 1}'], "afd.no_such_key"),
    (["--afd", "{not json"], "--afd: not valid JSON"),
    (["--afd", '{"role": "ffn"}'], "afd.role"),
    (["--afd", '{"num_ffn_ranks": 2}'], "afd.num_ffn_ranks"),
    (["--connector", "nope"], "afd.connector"),
    (["--", "--additional-config", '{"afd": {"async": "yes"}}'], "afd.async"),
    (["--", "--additional-config", "[1]"], "--additional-config: expected a JSON object"),
    (["--nope"], "unrecognized arguments: --nope"),
    (["--expert-replicas", "2"], "afd.expert_replicas: expected an integer in 1..1 (num_ffn_ranks), got 2"),
    (["--expert-replicas", "0"], "afd.expert_replicas"),
    (["--afd", '{"expert_replicas": 1}', "--expert-replicas", "2"], "afd.expert_replicas: 1 conflicts with"),
    (["--afd", '{"rendezvous": "ffn7"}'], "afd.rendezvous"),
    (["--afd", '{"transport": "nccl"}'], "afd.transport"),
    (["--transport", "nccl"], "argument --transport: invalid choice: 'nccl'"),
]


@pytest.fixture
def no_spawn(monkeypatch):
    """Fail the test if serve ever tries to start a process; returns the role commands it built."""
    built: list[list[str]] = []

    async def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"a process was started: {args}")

    monkeypatch.setattr(roles_module.asyncio, "create_subprocess_exec", refuse)

    def record(ctx):
        built.append([ctx.role, str(ctx.rank)])
        return ["true"]

    return RoleCommands(attention=record, ffn=record), built


@pytest.mark.parametrize(("args", "key"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_exit_2_one_line_nothing_started(args, key, no_spawn, capsys):
    commands, built = no_spawn
    port = free_port_block(3)
    head = [a for a in args if a != "--"] if "--" not in args else args[: args.index("--")]
    tail = args[args.index("--") :] if "--" in args else []
    argv = ["/models/m", "--attention", "2", "--ffn", "1", "--port", str(port), *head, *tail]
    rc = serve_cli.main(argv, commands=commands, gate=None)
    captured = capsys.readouterr()
    assert rc == 2
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("afd-mrv2 serve: error: ") and key in lines[0], lines
    assert built == []


@pytest.mark.parametrize(("attention", "ffn"), [(3, 2), (1, 2), (2, 3)], ids=["3A2F", "1A2F", "2A3F"])
def test_free_topologies_are_planned(attention, ffn):
    """F need not divide A nor be <= it: one process per rank, each with a valid afd section."""
    plan = build_plan(ServeOptions("m", attention, ffn, port=9000, attention_groups=attention), run_dir="/run/x")
    assert [r.name for r in plan.roles] == [f"ffn {f}" for f in range(ffn)] + [
        f"attention {a}" for a in range(attention)
    ]
    assert plan.backends == tuple(f"http://127.0.0.1:{9001 + a}" for a in range(attention))
    for spec in plan.roles:
        config = parse_afd_config(spec.afd)
        assert (config.role, config.rank) == (spec.role, spec.rank)
        assert (config.num_attention_ranks, config.num_ffn_ranks) == (attention, ffn)


@pytest.mark.parametrize(
    ("flag", "base", "expected"),
    [(None, None, "tcp"), ("zmq", None, "zmq"), (None, "zmq", "zmq"), ("gloo", None, "gloo")],
)
def test_the_transport_reaches_every_role(flag, base, expected):
    """--transport (or afd.transport under --afd) is every role's afd.transport: the pairs' two sides agree."""
    opts = ServeOptions(
        "m", 1, 2, port=9000, transport=flag, afd_json=None if base is None else json.dumps({"transport": base})
    )
    plan = build_plan(opts, run_dir="/run/x")
    assert {parse_afd_config(spec.afd).transport for spec in plan.roles} == {expected}


def test_free_topology_passes_the_cli_up_to_the_runtime_gate(no_spawn, capsys):
    """3A2F gets through the flags, the afd section and the plan; only the (refusing) runtime gate stops it."""
    commands, built = no_spawn
    gated = []

    def refuse(plan):
        gated.append([r.name for r in plan.roles])
        raise AfdError("runtime refused: vLLM is not installed")

    port = free_port_block(4)
    argv = ["/m", "--attention", "3", "--attention-groups", "3", "--ffn", "2", "--port", str(port)]
    rc = serve_cli.main(argv, commands=commands, gate=refuse)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == ["afd-mrv2 serve: error: runtime refused: vLLM is not installed"]
    assert gated == [["ffn 0", "ffn 1", "attention 0", "attention 1", "attention 2"]]  # planned, nothing started
    assert sorted(built) == [["attention", "0"], ["attention", "1"], ["attention", "2"], ["ffn", "0"], ["ffn", "1"]]


def test_refused_runtime_exit_2_one_line(no_spawn, capsys):
    commands, _ = no_spawn

    def refuse(plan):
        raise AfdError("runtime refused: vLLM is not installed")

    rc = serve_cli.main(
        ["/m", "--attention", "1", "--ffn", "1", "--port", str(free_port_block(3))], commands=commands, gate=refuse
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == ["afd-mrv2 serve: error: runtime refused: vLLM is not installed"]


def test_busy_port_exit_2(no_spawn, capsys):
    commands, _ = no_spawn
    port = free_port_block(3)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port + 1))  # attention rank 0's port
        holder.listen()
        rc = serve_cli.main(["/m", "--attention", "1", "--ffn", "1", "--port", str(port)], commands=commands, gate=None)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and f"port {port + 1}" in err[0]


def _vllm_installed() -> bool:
    from afd_mrv2.compat import check_runtime

    return check_runtime().accepted


@pytest.mark.parametrize(
    "args",
    [["--depth", "0"], ["--afd", '{"multistream": {"depth": "x"}}'], []],
    ids=["bad-depth", "bad-afd", "refused-runtime"],
)
def test_real_command_refuses_before_starting(args, tmp_path):
    if not args and _vllm_installed():
        pytest.skip("an accepted vLLM runtime is installed: the gate would pass")
    port = free_port_block(3)
    (tmp_path / "config.json").write_text(
        '{"num_local_experts": 8}'
    )  # a model folder (the runtime gate checks it first)
    cmd = [sys.executable, "-m", "afd_mrv2.cli", "serve", str(tmp_path), "--attention", "1", "--ffn", "1"]
    proc = subprocess.run([*cmd, "--port", str(port), *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("afd-mrv2 serve: error: "), lines
    assert "runtime refused" in lines[0] if not args else "afd.multistream.depth" in lines[0]


def test_plan_roles_ports_and_commands():
    opts = ServeOptions(
        model="/models/m",
        attention=4,
        attention_groups=4,
        ffn=2,
        port=9000,
        depth="auto",
        connector="simlink",
        afd_json='{"multistream": {"trace": true}}',
        extra=("--load-format", "dummy", "--additional-config", '{"afd": {"observers": []}, "other": 1}'),
    )
    plan = build_plan(opts, run_dir="/run/x")
    assert [r.name for r in plan.roles] == [
        "ffn 0",
        "ffn 1",
        "attention 0",
        "attention 1",
        "attention 2",
        "attention 3",
    ]
    assert plan.backends == tuple(f"http://127.0.0.1:{9001 + i}" for i in range(4))
    assert plan.afd["port"] == 9005  # the AFD rendezvous port, above the engines
    for spec in plan.roles:
        assert spec.afd["role"] == spec.role and spec.afd[RANK_KEY] == spec.rank
        assert spec.afd["multistream"] == {"trace": True, "enabled": True, "depth": "auto"}
        assert spec.afd["connector"] == "simlink" and spec.afd["observers"] == []
        config = json.loads(spec.argv[spec.argv.index("--additional-config") + 1])
        assert config["other"] == 1 and config["afd"] == dict(spec.afd)
        assert spec.argv.count("--additional-config") == 1  # serve's own, the extra one folded in
        assert spec.argv[-2:] == ("--load-format", "dummy")
    attention = plan.of("attention")[2]
    assert attention.argv[:3] == (sys.executable, "-m", "vllm.entrypoints.openai.api_server")
    assert attention.argv[attention.argv.index("--port") + 1] == "9003"
    assert attention.argv[attention.argv.index("--model") + 1] == "/models/m"
    ffn = plan.of("ffn")[1]
    # ffn_role MODEL -- VLLM ARGS: its afd section is the one in --additional-config
    assert ffn.argv[:6] == (sys.executable, "-m", "afd_mrv2.mrv2.ffn.role", "/models/m", "--", "--additional-config")
    assert ffn.ready_file == "/run/x/ffn-1.ready"  # for role commands that prefer a ready file
    for spec in plan.roles:
        assert spec.env["HF_HUB_OFFLINE"] == "1" and spec.env["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_each_role_is_pinned_to_its_own_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cpu_binds(2, [0, 1]) == ["0", "1"]
    assert cpu_binds(2, [4, 5, 6, 7, 8]) == ["4,5", "6,7"]
    assert cpu_binds(3, [0, 1]) == ["0", "1", "0"]
    assert cpu_binds(1, []) == [""]
    # every process of a role (RoleSpec.cores, the supervisor's preexec pin) on the cores its OpenMP threads get
    monkeypatch.setattr(serve_plan, "_available_cores", lambda: [4, 5, 6, 7])
    monkeypatch.delenv(serve_plan.CPU_BIND_ENV, raising=False)
    plan = build_plan(ServeOptions("m", 1, 2, port=9000), run_dir="/run/x")
    assert {r.name: (r.cores, r.env[serve_plan.CPU_BIND_ENV]) for r in plan.roles} == {
        "attention 0": ((4,), "4"),
        "ffn 0": ((5,), "5"),
        "ffn 1": ((6,), "6"),
    }
    monkeypatch.setenv(serve_plan.CPU_BIND_ENV, "0-3")  # the user's binding: serve pins no process
    assert [r.cores for r in build_plan(ServeOptions("m", 1, 2, port=9000), run_dir="/run/x").roles] == [()] * 3


def test_with_fewer_cores_than_processes_the_ffn_ranks_are_left_to_the_scheduler(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """DP1 TP2 with one FFN rank on 2 cores: each TP rank keeps a core (vLLM binds it), the FFN rank gets none and
    vLLM's "bind nothing", so it never waits behind a TP rank spinning in vLLM's shm all-reduce on its core."""
    monkeypatch.setattr(serve_plan, "_available_cores", lambda: [0, 1])
    monkeypatch.delenv(serve_plan.CPU_BIND_ENV, raising=False)
    plan = build_plan(ServeOptions("/models/m", 1, 1, port=9000, attention_tp=2), run_dir="/run/x")
    assert {r.name: (r.cores, r.env.get(serve_plan.CPU_BIND_ENV)) for r in plan.roles} == {
        "attention 0": ((0, 1), "0|1"),
        "ffn 0": ((), "nobind"),
    }
    # as many cores as processes: every role keeps its own
    monkeypatch.setattr(serve_plan, "_available_cores", lambda: [0, 1, 2])
    plan = build_plan(ServeOptions("/models/m", 1, 1, port=9000, attention_tp=2), run_dir="/run/x")
    assert {r.name: r.cores for r in plan.roles} == {"attention 0": (0, 1), "ffn 0": (2,)}


def test_rank_is_an_afd_option_checked_per_process():
    assert parse_afd_config({"connector": "x", "role": "ffn", "rank": 0}).rank == 0
    with pytest.raises(ConfigError, match=r"^afd\.rank: expected an integer in 0\.\.0 \(num_ffn_ranks is 1\), got 1$"):
        parse_afd_config({"connector": "x", "role": "ffn", "rank": 1})
    plan = build_plan(ServeOptions("m", 2, 1, port=9000, attention_groups=2), run_dir="/run/x")
    assert {(r.role, parse_afd_config(r.afd).rank) for r in plan.roles} == {
        ("ffn", 0),
        ("attention", 0),
        ("attention", 1),
    }
    assert parse_afd_config(plan.afd | {"role": "ffn"}).compute_gate_on_attention is True  # the default: vLLM's seam


def test_role_commands_are_data():
    seen = []

    def fake(ctx):
        seen.append((ctx.role, ctx.rank, ctx.port))
        return ["fake", ctx.role]

    plan = build_plan(
        ServeOptions("m", 2, 1, port=9000, attention_groups=2), RoleCommands(attention=fake, ffn=ffn_command)
    )
    assert seen == [("attention", 0, 9001), ("attention", 1, 9002)]
    assert plan.of("attention")[0].argv == ("fake", "attention")
    assert RoleCommands().attention is attention_command


@pytest.mark.parametrize(
    ("args", "v2", "expected"),
    [
        ([], "0", [("moe_seam",), ("moe_seam",)]),
        (["--depth", "2"], "0", [("moe_seam",), ("moe_seam", "multistream_ffn")]),
        (["--depth", "auto"], "1", [("moe_seam", "mrv2"), ("moe_seam", "mrv2", "multistream_ffn")]),
    ],
    ids=["serialized", "depth-2", "auto-on-v2"],
)
def test_runtime_gate_requires_what_every_role_process_will_require(monkeypatch, tmp_path, args, v2, expected):
    """The gate runs each role's RUNTIME admission check as that role's process will (afd_mrv2.admission,
    required_capabilities: the Attention role first, then the FFN role), so a pair that refuses a role
    refuses serve up front, in one line."""
    from types import SimpleNamespace

    from afd_mrv2.serve import app

    asked: list[tuple[str, ...]] = []

    def fake_check(require: tuple[str, ...] = ()) -> SimpleNamespace:
        asked.append(tuple(require))
        refused = "multistream_ffn" in require or len(asked) == 2  # the FFN role's needs are refused
        reasons = ("multistream_ffn not granted",) if refused else ()
        return SimpleNamespace(accepted=not refused, reasons=reasons, message=lambda: "; ".join(reasons))

    monkeypatch.setattr(app, "check_runtime", fake_check)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", v2)
    (tmp_path / "config.json").write_text('{"num_local_experts": 8}')  # the gate checks the model folder first
    plan = build_plan(ServeOptions(str(tmp_path), 1, 1, port=free_port_block(3), depth=(args or [None, None])[1]))
    with pytest.raises(AfdError, match=r"^runtime refused: multistream_ffn not granted \(afd-mrv2 compat lists"):
        app.runtime_gate(plan)
    assert asked == expected


def test_ubatches_selects_v2_the_afd_worker_and_eager_for_the_attention_engines_only() -> None:
    plan = build_plan(ServeOptions("/models/m", 2, 1, ubatches=2, extra=("--dtype", "float32"), attention_groups=2))
    for spec in plan.roles:
        assert spec.afd["ubatch"] == {"num_ubatches": 2}
        if spec.role == "attention":
            assert spec.env["VLLM_USE_V2_MODEL_RUNNER"] == "1"
            tail = list(spec.argv[spec.argv.index("--worker-extension-cls") + 2 :])
            assert tail == [
                "--worker-cls",
                "afd_mrv2.mrv2.attention.worker.AfdWorker",
                "--enforce-eager",
                "--load-format",
                "afd",
                "--dtype",
                "float32",
            ]
        else:
            assert "VLLM_USE_V2_MODEL_RUNNER" not in spec.env and "--worker-cls" not in spec.argv
    # a worker or eager flag the user passed is not doubled; without --ubatches nothing is added
    mine = build_plan(
        ServeOptions("/models/m", 1, 1, ubatches=1, extra=("--worker-cls", "my.Worker", "--enforce-eager"))
    )
    attention = mine.of("attention")[0]
    assert attention.argv.count("--worker-cls") == 1 and attention.argv.count("--enforce-eager") == 1
    plain = build_plan(ServeOptions("/models/m", 1, 1)).of("attention")[0]
    assert "--worker-cls" not in plain.argv and "VLLM_USE_V2_MODEL_RUNNER" not in plain.env


@pytest.mark.parametrize(
    ("value", "fragment"), [("0", "expected an integer in 1..4"), ("5", "expected an integer in 1..4")]
)
def test_bad_ubatches_is_one_line_before_anything_starts(value: str, fragment: str) -> None:
    with pytest.raises(AfdError, match=rf"^afd\.ubatch\.num_ubatches: {fragment}"):
        build_plan(ServeOptions("/models/m", 1, 1, ubatches=int(value)))


def test_a_missing_model_folder_is_refused_in_one_line(tmp_path):
    from afd_mrv2.serve.plan import check_model_folder

    with pytest.raises(AfdError, match=rf"^model folder {tmp_path}/nope does not exist$"):
        check_model_folder(str(tmp_path / "nope"))
    with pytest.raises(AfdError, match=r"has no config.json"):
        check_model_folder(str(tmp_path))
    (tmp_path / "config.json").write_text('{"num_local_experts": 8}')
    check_model_folder(str(tmp_path))
    check_model_folder("mistralai/Mixtral-8x7B-v0.1")  # a Hugging Face repository id is vLLM's to resolve


def test_a_plugin_of_an_unserved_hook_api_is_refused_in_the_preflight(tmp_path, monkeypatch, capsys, no_spawn):
    """serve resolves the plugins every role will load before it plans a process: a connector written for a
    hook API this afd-mrv2 does not serve is one line, exit 2, nothing started (the runtime gate not reached)."""
    from tests.connectors import install_distribution

    install_distribution("afd_echo_api1", tmp_path, monkeypatch)
    (tmp_path / "afd_echo_api1.py").write_text(
        (tmp_path / "afd_echo_api1.py").read_text().replace("hook_api_version = 1", "hook_api_version = 99")
    )
    commands, _planned = no_spawn
    gated = []
    argv = ["/m", "--attention", "1", "--ffn", "1", "--connector", "echo_api1", "--port", str(free_port_block(3))]
    rc = serve_cli.main(argv, commands=commands, gate=gated.append)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(
        "afd-mrv2 serve: error: connector 'echo_api1' (afd_echo_api1.EchoLink) was written for hook API 99; "
    ), err
    assert "serves hook API 0 to 2" in err[0] and gated == []


def test_test_port_blocks_avoid_the_kernels_ephemeral_range():
    """A block picked for a test lies outside the range the FFN engines' port-0 sockets draw from
    (CI once lost an Attention engine to EADDRINUSE: its port, free at pick time, was taken meanwhile)."""
    eph = ephemeral_ports()
    for _ in range(50):
        base = free_port_block(4)
        assert not ports_in_ephemeral_range(range(base, base + 4)), (base, eph)


def test_serve_warns_when_a_port_bound_after_the_ffn_ranks_is_ephemeral(tmp_path):
    eph = ephemeral_ports()
    log = io.StringIO()
    risky = build_plan(ServeOptions(str(tmp_path), 2, 1, port=eph.start + 100, attention_groups=2))
    Supervisor(risky, out=io.StringIO(), log=log)._warn_ephemeral()
    line = log.getvalue().strip()
    assert line.startswith("[serve] warning: port(s) ") and f"{eph.start + 101}, {eph.start + 102}" in line
    assert f"--port below {eph.start - 4}" in line and len(line.splitlines()) == 1
    safe = build_plan(ServeOptions(str(tmp_path), 2, 1, port=eph.start - 10, attention_groups=2))
    quiet = io.StringIO()
    Supervisor(safe, out=io.StringIO(), log=quiet)._warn_ephemeral()
    assert quiet.getvalue() == ""


# ------------------------------------------------------------------ the placement table


def _model(tmp_path, experts: int) -> str:
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["MixtralForCausalLM"], "num_local_experts": experts})
    )
    return str(tmp_path)


def test_the_plan_writes_the_resolved_table_into_every_roles_section(tmp_path) -> None:
    """config.json gives 10 experts: every role's section (and its --additional-config) carries the same table,
    the ring with balanced blocks; each role's parsed section places the model's experts by it."""
    plan = build_plan(ServeOptions(_model(tmp_path, 10), 2, 3, port=free_port_block(4), expert_replicas=2))
    ring = Placement.ring(10, 3, 2)
    assert plan.num_experts == 10 and plan.placement == ring and plan.expert_replicas == 2
    for spec in plan.roles:
        assert spec.afd["placement"] == ring.table()
        additional = json.loads(spec.argv[spec.argv.index("--additional-config") + 1])
        assert additional["afd"]["placement"] == ring.table()
        assert parse_afd_config(spec.afd).placement_for(10) == ring


def test_a_given_table_travels_as_given_and_must_place_the_models_experts(tmp_path) -> None:
    table = {"holders": [[1], [0, 1], [0]]}
    afd = json.dumps({"placement": table})
    plan = build_plan(ServeOptions(_model(tmp_path, 3), 1, 2, port=free_port_block(3), afd_json=afd))
    assert all(spec.afd["placement"] == table for spec in plan.roles) and plan.expert_replicas == 2
    with pytest.raises(ConfigError, match=r"^afd\.placement\.holders: the table places 3 experts, the model has 8"):
        build_plan(ServeOptions(_model(tmp_path, 8), 1, 2, port=free_port_block(3), afd_json=afd))


def test_without_an_expert_count_the_sections_carry_no_table(tmp_path) -> None:
    plan = build_plan(ServeOptions(str(tmp_path / "no-such-model"), 1, 2, port=free_port_block(3)))
    assert plan.num_experts is None and all("placement" not in spec.afd for spec in plan.roles)


def test_serve_prints_the_table_its_digest_and_each_ranks_experts(tmp_path) -> None:
    plan = build_plan(ServeOptions(_model(tmp_path, 10), 1, 3, port=free_port_block(3)))
    log = io.StringIO()
    Supervisor(plan, out=io.StringIO(), log=log)._say_placement()
    ring = Placement.ring(10, 3)
    assert log.getvalue().splitlines() == [
        f"[serve] placement: ring, 10 experts on 3 FFN ranks, 1 replica ({ring.stamp.short})",
        "[serve] placement: FFN rank 0: experts 0-3 (4; primary 0-3)",
        "[serve] placement: FFN rank 1: experts 4-6 (3; primary 4-6)",
        "[serve] placement: FFN rank 2: experts 7-9 (3; primary 7-9)",
    ]
    one = build_plan(ServeOptions(_model(tmp_path, 4), 1, 1, port=free_port_block(3)))
    log = io.StringIO()
    Supervisor(one, out=io.StringIO(), log=log)._say_placement()  # one FFN rank: the table, with its digest
    assert (
        log.getvalue().splitlines()[0]
        == f"[serve] placement: ring, 4 experts on 1 FFN rank, 1 replica ({Placement.ring(4, 1).stamp.short})"
    )


@pytest.mark.parametrize(
    ("transport", "afd", "expected"),
    [
        (None, None, "[serve] transport: tcp (every Attention-FFN pair), pair sockets bound to the route to 127.0.0.1"),
        ("gloo", None, "[serve] transport: gloo (every Attention-FFN pair)"),
        (
            "zmq",
            None,
            "[serve] transport: zmq (every Attention-FFN pair), pair sockets bound to the route to 127.0.0.1",
        ),
        (
            "zmq",
            '{"bind": "10.0.0.5"}',
            "[serve] transport: zmq (every Attention-FFN pair), pair sockets bound to 10.0.0.5",
        ),
        (
            "tcp",
            None,
            "[serve] transport: tcp (every Attention-FFN pair), pair sockets bound to the route to 127.0.0.1",
        ),
    ],
)
def test_serve_prints_the_transport_its_pairs_run_on(transport, afd, expected) -> None:
    plan = build_plan(ServeOptions("m", 1, 1, port=free_port_block(3), transport=transport, afd_json=afd))
    log = io.StringIO()
    Supervisor(plan, out=io.StringIO(), log=log)._say_transport()
    assert log.getvalue().splitlines() == [expected]


def test_attention_engines_load_with_the_afd_format_unless_told_otherwise_or_on_vllm_ascend(monkeypatch) -> None:
    """The Attention engine reads no routed-expert tensor (``--load-format afd``); a format in the extra
    arguments wins; on vLLM-Ascend afd-mrv2 registers no load format, so none is passed."""
    from afd_mrv2.compat import Runtime, detect

    def attention_argv(*extra: str) -> list[str]:
        return list(build_plan(ServeOptions("/models/m", 1, 1, extra=extra)).of("attention")[0].argv)

    argv = attention_argv()
    assert argv[argv.index("--load-format") + 1] == "afd" and argv.count("--load-format") == 1
    assert "--load-format" not in build_plan(ServeOptions("/models/m", 1, 1)).of("ffn")[0].argv
    assert attention_argv("--load-format", "dummy").count("--load-format") == 1
    assert "afd" not in attention_argv("--load-format=pt")
    ascend = Runtime("3.11.7", "0.30.0", "0.30.0rc2", "2.10.0", "2.10.0.post4", "9.2.0")
    monkeypatch.setattr(detect, "detect_runtime", lambda: ascend)
    assert "--load-format" not in attention_argv()


def test_an_attention_group_is_one_vllm_deployment_of_its_dp_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--attention 2``: one Attention role process, vLLM's DP front end over two DP ranks, each pinned to its
    own core through vLLM's pipe-separated binding; every role's section says the group's size."""
    monkeypatch.setattr(serve_plan, "_available_cores", lambda: [0, 1, 2])
    monkeypatch.delenv(serve_plan.CPU_BIND_ENV, raising=False)
    plan = build_plan(ServeOptions("/models/m", 2, 1, port=9000), run_dir="/run/x")
    assert [r.name for r in plan.roles] == ["ffn 0", "attention 0"]
    group = plan.of("attention")[0]
    argv = list(group.argv)
    assert argv[argv.index("--data-parallel-size") + 1] == "2" and argv[argv.index("--api-server-count") + 1] == "1"
    assert "--tensor-parallel-size" not in argv and argv[argv.index("--port") + 1] == "9001"
    assert group.env[serve_plan.CPU_BIND_ENV] == "0|1" and group.cores == (0, 1)
    assert plan.of("ffn")[0].env[serve_plan.CPU_BIND_ENV] == "2"
    assert (group.afd["rank"], group.afd["attention_group_size"], group.afd["num_attention_ranks"]) == (0, 2, 2)
    assert plan.of("ffn")[0].afd["attention_group_size"] == 2 and group.afd_ranks == (0, 1)
    assert group.title == "attention group 0 (AFD ranks 0-1)"
    assert "--data-parallel-size" not in plan.of("ffn")[0].argv
    assert plan.backends == ("http://127.0.0.1:9001",)


def test_groups_and_tensor_parallel_ranks_are_laid_out_per_group() -> None:
    plan = build_plan(ServeOptions("/models/m", 4, 1, port=9000, attention_groups=2, attention_tp=2), run_dir="/x")
    groups = plan.of("attention")
    assert [(g.afd["rank"], g.afd_ranks) for g in groups] == [(0, (0, 1, 2, 3)), (4, (4, 5, 6, 7))]
    assert all(g.afd["num_attention_ranks"] == 8 and g.afd["attention_group_size"] == 4 for g in groups)
    for g in groups:
        argv = list(g.argv)
        assert argv[argv.index("--data-parallel-size") + 1] == "2"
        assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    one = build_plan(ServeOptions("/models/m", 2, 1, port=9000, attention_groups=2), run_dir="/x").of("attention")
    assert [(g.afd["rank"], g.title) for g in one] == [(0, "attention rank 0"), (1, "attention rank 1")]
    assert all("--data-parallel-size" not in g.argv for g in one)


@pytest.mark.parametrize(
    ("opts", "line"),
    [
        ({"attention": 3, "attention_groups": 2}, "--attention-groups must divide --attention (3) into groups"),
        ({"attention": 2, "attention_tp": 0}, "--attention-tp must be >= 1, got 0"),
        (
            {"attention": 2, "extra": ("--data-parallel-size", "2")},
            "--data-parallel-size after -- would reach every role, the FFN ranks too",
        ),
        (
            {"attention": 1, "extra": ("--tensor-parallel-size=2",)},
            "--tensor-parallel-size after -- would reach every role",
        ),
    ],
)
def test_a_bad_group_layout_is_refused_in_one_line(opts: dict[str, object], line: str) -> None:
    with pytest.raises(AfdError) as info:
        build_plan(ServeOptions("/models/m", ffn=1, port=9000, **opts), run_dir="/x")  # type: ignore[arg-type]
    assert str(info.value).startswith(line) and "\n" not in str(info.value)
