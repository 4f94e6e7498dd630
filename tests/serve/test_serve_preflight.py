"""serve's pre-flight runs the admission checks (afd_mrv2.admission) by stage, without vLLM: CONFIG while it
plans, MODEL on config.json before its child starts, RUNTIME per role; the child's MODEL check on built layers.

The child itself, with real vLLM, is tests/vllm/test_serve_preflight.py.
"""

from __future__ import annotations

import json

import pytest

from afd_mrv2.admission import ModelFacts
from afd_mrv2.errors import AfdError, ConfigError, PluginError
from afd_mrv2.serve import app
from afd_mrv2.serve.plan import Plan, RoleCommands, RoleContext, ServeOptions, build_plan
from afd_mrv2.serve.preflight import ModelLayers, check_model
from tests.serve.conftest import free_port_block


def recording_commands(built: list[str]) -> RoleCommands:
    def record(ctx: RoleContext) -> list[str]:
        built.append(f"{ctx.role} {ctx.rank}")
        return ["true"]

    return RoleCommands(attention=record, ffn=record)


@pytest.mark.parametrize(
    ("opts", "error", "line"),
    [
        (
            {"afd_json": '{"compute_gate_on_attention": false}'},
            ConfigError,
            "afd.compute_gate_on_attention: expected true on the vLLM path",
        ),
        (
            {"connector": "simlink", "ubatches": 2},
            ConfigError,
            "afd.ubatch.num_ubatches: connector 'simlink' does not declare carries_stage_identity",
        ),
        ({"connector": "nope"}, PluginError, "afd.connector: 'nope' is not installed; installed connectors: "),
    ],
    ids=["router-on-attention", "stage-identity", "connector-installed"],
)
def test_the_plan_runs_the_config_checks_before_any_role_is_laid_out(opts, error, line) -> None:
    built: list[str] = []
    with pytest.raises(error) as info:
        build_plan(ServeOptions("/models/m", 1, 1, **opts), recording_commands(built))
    assert str(info.value).startswith(line) and "\n" not in str(info.value), str(info.value)
    assert built == []


def test_the_gate_refuses_what_config_json_decides_before_its_child_starts(tmp_path, monkeypatch) -> None:
    def no_child(plan: Plan) -> None:
        raise AssertionError("the vLLM child was started")

    monkeypatch.setattr(app, "DeploymentCheck", no_child)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MixtralForCausalLM"], "num_local_experts": 2}))
    with pytest.raises(ConfigError) as few:  # the plan resolves the placement: it refuses first
        app.runtime_gate(build_plan(ServeOptions(str(tmp_path), 1, 3, port=free_port_block(4))))
    assert str(few.value).startswith("afd.num_ffn_ranks: num_experts (2) must be at least the FFN ranks (3)")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MixtralForCausalLM"], "num_local_experts": 8}))
    uneven = build_plan(ServeOptions(str(tmp_path), 1, 3, port=free_port_block(4)))  # E % F != 0: 3, 3, 2 experts
    assert [uneven.placement.held_by(f) for f in range(3)] == [(0, 1, 2), (3, 4, 5), (6, 7)]
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 64}))
    with pytest.raises(ConfigError, match=r"^afd: the model \(LlamaForCausalLM\) has no routed-experts layer"):
        app.runtime_gate(build_plan(ServeOptions(str(tmp_path), 1, 1, port=free_port_block(3))))


def test_a_config_with_experts_is_left_to_the_child_which_decides_from_the_layers(tmp_path, monkeypatch) -> None:
    """config.json gives 8 experts: serve's own process cannot tell whether any layer is MoE; the child's MODEL
    check on the layers vLLM builds refuses, in the one line serve prints."""
    started: list[object] = []

    class Child:
        def __init__(self, plan: Plan) -> None:
            started.append(plan)

        def result(self) -> None:
            layers = ModelLayers(str(tmp_path))
            layers.facts = ModelFacts(("Qwen2MoeForCausalLM",), 8, moe_layers=0, layers=2)  # as built on meta
            try:
                check_model(dict(plan.afd) | {"role": "ffn"}, layers)
            except AfdError as exc:
                raise AfdError(str(exc)) from None

        def cancel(self) -> None:
            raise AssertionError("cancelled")

    monkeypatch.setattr(app, "DeploymentCheck", Child)
    monkeypatch.setattr(app, "check_runtime_pair", lambda plan: None)  # whatever this machine's runtime is
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen2MoeForCausalLM"], "num_experts": 8}))
    plan = build_plan(ServeOptions(str(tmp_path), 1, 2, port=free_port_block(3)))
    with pytest.raises(AfdError) as info:
        app.runtime_gate(plan)
    assert started == [plan]
    assert str(info.value).startswith(
        "afd: the model (Qwen2MoeForCausalLM) has no routed-experts layer: its config gives 8 routed experts"
    )
