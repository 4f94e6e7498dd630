"""Unsupported combinations fail at configuration time, before any communication, with one clear line."""

from __future__ import annotations

import pytest
import torch

from afd_mrv2.config import parse_afd_config
from afd_mrv2.errors import ConfigError, PluginError
from afd_mrv2.hooks.cam.common import OPS_RESOURCE
from afd_mrv2.hooks.cam.evidence import Evidence, OpEvidence, StreamBehaviour
from afd_mrv2.hooks.p2p import P2pShape
from afd_mrv2.plugins import AttentionContext, load_plugins, role_context
from afd_mrv2.support_matrix import Deployment, check_deployment
from tests.hooks.cam.harness import MODEL
from tests.support.cam_fabric import Fabric
from tests.support.camasync_doubles import CamAsyncDoubles
from tests.support.camp2p_doubles import CamP2PDoubles

CURRENT_EVIDENCE = Evidence(
    {},
    {
        f"{ns}.{op}": OpEvidence(f"{ns}.{op}", True, StreamBehaviour.CURRENT)
        for ns, ops in (("afd_ascend", CamP2PDoubles.OPS), ("umdk_cam_op_lib", CamAsyncDoubles.OPS))
        for op in ops
    },
)


def camasync(**afd):
    base = {"connector": "camasync", "role": "attention", "async": True, "compute_gate_on_attention": True}
    return parse_afd_config({**base, **afd})


def camp2p(**afd):
    return parse_afd_config({"connector": "camp2p", "role": "attention", "compute_gate_on_attention": False, **afd})


def build(config, *, evidence=CURRENT_EVIDENCE, doubles=True, **resources):
    kind = CamP2PDoubles if config.connector == "camp2p" else CamAsyncDoubles
    res = {
        "model": MODEL.spec,
        "role_rank": 0,
        "source": lambda i: None,
        "sink": lambda i, o: None,
        "hccl_groups": ("afd0", "afd1"),
        "cam_group": "g",
        "stage_token_counts": lambda i: [1],
        **resources,
    }
    if doubles:
        res[OPS_RESOURCE] = kind(Fabric()).opset(0, evidence)
    return load_plugins(role_context(config, **res)).connector


def refused(config_or_fn, match: str, **kwargs) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        build(config_or_fn() if callable(config_or_fn) else config_or_fn, **kwargs)
    assert "\n" not in str(info.value)
    assert match in str(info.value), str(info.value)
    return info.value


# depth 1: one input and one output buffer, the counts a pipelined attention side with two stages needs
MS = {"enabled": True, "roles": ["attention", "ffn"], "depth": 1, "backend": "host"}
MOE = {"enabled": True, "split": "token"}


def test_supported_defaults_build() -> None:
    assert build(camasync()).stages == 1
    assert build(camasync(async_moe=MOE, multistream=MS)).stages == 2
    assert build(camp2p(multistream=MS)).groups == ("afd0", "afd1")


@pytest.mark.parametrize(
    ("make", "key", "text"),
    [
        (lambda: camasync(**{"async": False}), "afd.async", "needs async DP"),
        (lambda: camasync(compute_gate_on_attention=False), "afd.compute_gate_on_attention", "expected true"),
        (
            lambda: camasync(async_moe=MOE, multistream={**MS, "depth": 3}),
            "afd.multistream.depth",
            "must be at most the number of stages (2); got 3 + 3",
        ),
        (lambda: camasync(multistream=MS), "afd.multistream.depth", "with one stage no counts do"),
        (
            lambda: camasync(connector_extra_config={"async_moe_split": "token"}),
            "afd.connector_extra_config.async_moe_split",
            "use afd.async_moe",
        ),
        (
            lambda: camasync(connector_extra_config={"dynamicQuant": 2}),
            "afd.connector_extra_config.dynamicQuant",
            "0..1",
        ),
        (lambda: camasync(connector_extra_config={"queue": 1}), "afd.connector_extra_config.queue", "unknown key"),
        (
            lambda: camp2p(compute_gate_on_attention=True, async_moe=MOE),
            "afd.async_moe.enabled",
            "needs connector camasync",
        ),
        (lambda: camp2p(compute_gate_on_attention=True), "afd.compute_gate_on_attention", "expected false"),
        (
            lambda: camp2p(connector_extra_config={"quant_mode": 1}),
            "afd.connector_extra_config.quant_mode",
            "only quant_mode 0",
        ),
        (
            lambda: camp2p(multistream={**MS, "depth": 2}),
            "afd.multistream.depth",
            "must be at most the number of stages (2); got 2 + 2; use depth 1",
        ),
        (
            lambda: camp2p(multistream={**MS, "buffers": {"in": 1, "out": 2}}),
            "afd.multistream.buffers",
            "got 1 + 2",
        ),
    ],
)
def test_connector_refusals(make, key: str, text: str) -> None:
    error = refused(make, text)
    assert error.key == key


def test_more_than_two_stages() -> None:
    with pytest.raises(ConfigError, match=r"afd.async_moe.num_stages: expected 2"):
        camasync(async_moe={**MOE, "num_stages": 3})
    refused(camp2p(), "more than two stages is not supported", hccl_groups=("a", "b", "c"))


def test_multistream_needs_verified_stream_behaviour() -> None:
    error = refused(camasync(async_moe=MOE, multistream=MS), "is unverified; run `afd-mrv2 probe npu`", evidence=None)
    assert error.key == "afd.multistream.enabled"
    build(camasync(async_moe=MOE), evidence=None)  # serialized stays available


@pytest.mark.parametrize(
    ("config", "names"), [(camasync, "umdk_cam_op_lib.async_dispatch_send"), (camp2p, "afd_ascend.a2e")]
)
def test_real_operators_missing_fail_before_anything_runs(config, names: str) -> None:
    with pytest.raises(PluginError, match=f"operators not registered with torch: {names}"):
        build(config(), doubles=False)


def test_test_switch_must_be_an_opset() -> None:
    with pytest.raises(PluginError, match="must be an OpSet"):
        load_plugins(
            AttentionContext(
                config=camasync(),
                model=MODEL.spec,
                role_rank=0,
                source=print,
                sink=print,
                cam_group="g",
                cam_ops=object(),
            )
        )


def test_resources_are_checked() -> None:
    with pytest.raises(PluginError, match=r"needs the runtime resource 'model'.*\(provided: role_rank\)"):
        load_plugins(AttentionContext(config=camasync(), role_rank=0))
    with pytest.raises(PluginError, match="runtime resource 'model' must be a CamModelSpec, got P2pShape"):
        build(camasync(), model=P2pShape(8, 2, 4, 2, 4))  # another connector's model spec
    with pytest.raises(PluginError, match="runtime resource 'cam_stage_tags' must be a StageTags, got str"):
        build(camasync(), cam_stage_tags="tags")
    with pytest.raises(PluginError, match=r"role_rank 3 is outside 0\.\.0"):
        build(camasync(), role_rank=3)
    with pytest.raises(PluginError, match="'hccl_groups' must be a sequence"):
        build(camp2p(), hccl_groups="afd")


# ----------------------------------------------------------------- deployment facts


@pytest.mark.parametrize(
    ("config", "deployment", "key", "text"),
    [
        (
            lambda: camasync(async_moe=MOE),
            Deployment(native_dbo=True),
            "afd.async_moe.enabled",
            "native DBO (--enable-dbo) cannot be combined with CAMAsync async-MoE stages",
        ),
        (camasync, Deployment(native_dbo=True), "afd.connector", "cannot be combined with CAMAsync"),
        (camasync, Deployment(enforce_eager=False), "afd.connector", "eager only"),
        (
            lambda: camasync(async_moe=MOE),
            Deployment(decode_context_parallel_size=2),
            "afd.async_moe.enabled",
            "decode_context_parallel_size=2",
        ),
        (
            lambda: camasync(async_moe=MOE),
            Deployment(prefill_context_parallel_size=8),
            "afd.async_moe.split",
            "use the request split",
        ),
        (lambda: camp2p(multistream=MS), Deployment(enforce_eager=False), "afd.multistream.enabled", "eager only"),
    ],
)
def test_deployment_refusals(config, deployment: Deployment, key: str, text: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_deployment(config(), deployment)
    assert info.value.key == key and text in str(info.value)
    with pytest.raises(ConfigError, match=text.replace("(", r"\(").replace(")", r"\)")):
        build(config(), deployment=deployment)  # the connector runs the same check at construction


@pytest.mark.parametrize(
    "deployment",
    [
        Deployment(),
        Deployment(tensor_parallel_size=2, sequence_parallel=True, data_parallel_size=3),
        Deployment(prefill_context_parallel_size=8),
    ],
)
def test_supported_deployments(deployment: Deployment) -> None:
    config = camasync(async_moe={"enabled": True, "split": "request"})
    check_deployment(config, deployment)
    check_deployment(camp2p(), Deployment(native_dbo=True, enforce_eager=False))  # CAMP2P serialized: DBO and graphs ok


def test_torch_dtype_of_placeholders_follows_the_model() -> None:
    assert build(camasync())._recv_placeholder.dtype == torch.float32


def test_the_old_ops_resource_name_works_with_a_deprecation_warning():
    ops = CamAsyncDoubles(Fabric()).opset(0, CURRENT_EVIDENCE)
    with pytest.warns(DeprecationWarning, match=r"'cam_test_ops' is deprecated since hook API 1: use 'cam_ops'"):
        connector = build(camasync(), doubles=False, cam_test_ops=ops)
    assert connector.ops is ops
