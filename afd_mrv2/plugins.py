"""The plugin manager: discovers connectors and observers, registers the chosen ones.

Entry-point group ``afd_mrv2``; :class:`AttentionContext`, :class:`FfnContext`, :func:`check_plugins`.

See docs/internals/hooks-api.md, "afd_mrv2.plugins".
"""

from __future__ import annotations

import importlib.metadata
import logging
import types
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, ClassVar, TypeVar

import pluggy

from afd_mrv2 import hookspecs
from afd_mrv2.config import AfdConfig, MultistreamConfig
from afd_mrv2.default_streams import DefaultStreams
from afd_mrv2.devices.base import DeviceBackend, Stream
from afd_mrv2.errors import PluginError
from afd_mrv2.hookspecs import HOOK_API_VERSION, OLDEST_SERVED_HOOK_API
from afd_mrv2.items import ATTENTION, FFN, WorkItem
from afd_mrv2.support_matrix import Deployment

ENTRY_POINT_GROUP = "afd_mrv2"
PHASE_HOOKS = ("on_recv", "on_compute", "on_send")
HOOK_NAMES = ("create_streams", *PHASE_HOOKS, "on_cleanup")

log = logging.getLogger(__name__)
T = TypeVar("T")


class ConnectorContext:
    """What a connector or observer factory receives: the parsed ``afd`` section and its owner's runtime objects.

    Since hook API 2 a factory receives an :class:`AttentionContext` or an :class:`FfnContext`
    (this class's two subclasses, one per role), whose fields name and type every runtime object
    afd-mrv2's runners provide; read those fields.  ``config`` is the parsed ``afd`` section
    (``config.extra`` is ``connector_extra_config``), :attr:`role` this process's role.

    Hook API 1's form keeps working for one more API version, with a ``DeprecationWarning``:
    ``ConnectorContext(config, resources)`` (the objects by name), ``context.resources`` and
    ``context.resource(name)`` (on every context; the names are the typed contexts' field names).
    A connector that accepts either form calls :meth:`typed` first.
    """

    config: AfdConfig

    def __init__(self, config: AfdConfig, resources: Mapping[str, Any] | None = None) -> None:
        if resources:
            _deprecated(
                "ConnectorContext(config, resources)",
                "AttentionContext(config=..., ...) or FfnContext(config=..., ...), or role_context(config, ...)",
            )
        self.config = config
        self._legacy = MappingProxyType(dict(resources or {}))

    def __repr__(self) -> str:
        return f"ConnectorContext(config={self.config!r}, resources={dict(self._legacy)!r})"

    @property
    def role(self) -> str:
        """This process's AFD role, ``attention`` or ``ffn`` (``config.role``)."""
        return self.config.role

    def typed(self) -> AttentionContext | FfnContext:
        """This context as its role's typed context (a typed context is returned as it is).

        The objects of the API-1 form go to the fields of the same name; names no field has go
        to ``extras``.
        """
        return role_context(self.config, **self._legacy)

    def need(self, value: T | None, name: str) -> T:
        """``value`` (a field of this context), or the :class:`PluginError` saying the owner must provide ``name``."""
        if value is None:
            raise PluginError(
                f"connector {self.config.connector!r} needs the runtime resource {name!r}, which its runner did "
                f"not provide (provided: {', '.join(sorted(self._provided())) or 'none'})"
            )
        return value

    @property
    def resources(self) -> Mapping[str, Any]:
        """Deprecated since hook API 2: the runtime objects by name; read the typed context's fields."""
        _deprecated("ConnectorContext.resources", "the fields of AttentionContext / FfnContext")
        return self._provided()

    def resource(self, name: str) -> Any:
        """Deprecated since hook API 2: the named runtime object, or a :class:`PluginError` saying who must
        provide it; read the typed context's fields."""
        _deprecated("ConnectorContext.resource(name)", "the fields of AttentionContext / FfnContext")
        return self.need(self._provided().get(name), name)

    def _provided(self) -> Mapping[str, Any]:
        """The runtime objects the owner provided, by name (the API-1 ``resources``)."""
        return self._legacy


@dataclass(frozen=True, kw_only=True)
class RoleContext(ConnectorContext):
    """The fields both roles' contexts have; see :class:`AttentionContext` and :class:`FfnContext`.

    Every field but ``config`` is optional (None: not provided); a connector fails with a clear
    :class:`PluginError` when one it needs is missing (:meth:`need`).  Types that belong to a
    connector (its model spec, its link) are checked by that connector.
    """

    #: The parsed ``afd`` section; its ``role`` is this context's role.
    config: AfdConfig
    #: The connector's model-side spec, for its buffer shapes: torch_p2p a ``P2pShape``
    #: (:mod:`afd_mrv2.hooks.p2p.common`), camp2p / camasync a ``CamModelSpec`` (:mod:`afd_mrv2.hooks.cam.common`).
    model: object | None = None
    #: ``source(item)``: the owner's data for each work item.  simlink: each item's inputs; CAM
    #: Attention side: layer 0's hidden states; torch_p2p Attention side: each item's routed batch
    #: ``(hidden, topk_ids, topk_weights)``.
    source: Callable[[WorkItem], Any] | None = None
    #: ``sink(item, result)``: where the connector delivers each item's result (a sink that takes a
    #: result still in flight declares it: :class:`afd_mrv2.api.InFlightSink`).  simlink: each item's
    #: outputs; CAM Attention side: the last layer's output.  torch_p2p Attention side: given, each
    #: item is one round trip (the owner waits for it, as ``UBatchExchange`` does); None, the owner
    #: drives the layer loop (the layer-pipelined side).
    sink: Callable[[WorkItem, Any], None] | None = None
    #: torch_p2p: the process's ``PeerLink`` (:mod:`afd_mrv2.hooks.p2p.link`), built by the owner on its
    #: process group before any executor (its control channel outlives every executor of the process).
    p2p_link: object | None = None
    #: camp2p / camasync: this process's rank within its role (0-based).
    role_rank: int | None = None
    #: camp2p / camasync: the torch device of the operators' tensors (None: ``cpu``).
    device: str | None = None
    #: camp2p / camasync: vLLM's deployment facts, checked against the support matrix at construction.
    deployment: Deployment | None = None
    #: camp2p / camasync: the operators to call, an ``OpSet`` (:mod:`afd_mrv2.hooks.cam.ops`) the owner
    #: built (tests pass doubles); None: the connector resolves ``torch.ops`` itself.
    cam_ops: object | None = None
    #: camp2p / camasync: the stage-identity side channel, a ``StageTags`` (:mod:`afd_mrv2.hooks.cam.stage_tags`);
    #: None: the one of ``cam_ops``.
    cam_stage_tags: object | None = None
    #: camp2p: the HCCL communicator names, one per stage.
    hccl_groups: Sequence[str] | None = None
    #: camasync: the HCCL communicator name of the CAM group.
    cam_group: str | None = None
    #: A third-party connector's own runtime objects, by name (what no field above names).
    extras: Mapping[str, Any] = field(default_factory=dict)

    #: the role this class is the context of
    _ROLE: ClassVar[str] = ""

    def __post_init__(self) -> None:
        if self.config.role != self._ROLE:
            raise PluginError(
                f"{type(self).__name__} is the context of the {self._ROLE} role, but afd.role is {self.config.role!r}"
            )
        object.__setattr__(self, "extras", MappingProxyType(dict(self.extras)))

    def __repr__(self) -> str:
        shown = {name: value for name, value in self._fields().items() if name != "extras" or value}
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in shown.items())})"

    def typed(self) -> AttentionContext | FfnContext:
        assert isinstance(self, (AttentionContext, FfnContext))
        return self

    def _fields(self) -> dict[str, Any]:
        """``config`` and every field set (not None, not its default)."""
        values = {f.name: (getattr(self, f.name), f.default) for f in fields(self)}
        return {name: value for name, (value, default) in values.items() if value is not default}

    def _provided(self) -> Mapping[str, Any]:
        provided = {name: value for name, value in self._fields().items() if name not in ("config", "extras")}
        return MappingProxyType({**self.extras, **provided})


@dataclass(frozen=True, kw_only=True, repr=False)
class AttentionContext(RoleContext):
    """What a factory receives on the Attention role (``afd.role: attention``): :class:`RoleContext`'s fields."""

    _ROLE: ClassVar[str] = ATTENTION


@dataclass(frozen=True, kw_only=True, repr=False)
class FfnContext(RoleContext):
    """What a factory receives on the FFN role (``afd.role: ffn``): :class:`RoleContext`'s fields and these."""

    _ROLE: ClassVar[str] = FFN

    #: torch_p2p: the global ranks of the Attention ranks this executor serves (None: all of them).  An
    #: owner whose Attention ranks are independent engines runs one executor per Attention rank.
    attention_peers: Sequence[int] | None = None
    #: torch_p2p: take each item's layer and stage identity from the Attention side's headers instead of
    #: from the submitted item (an owner that cannot know whether a step was split accepts both).
    follow_stages: bool = False
    #: torch_p2p: called with each item's identity as received, once its headers were validated.
    on_item: Callable[[WorkItem], None] | None = None
    #: torch_p2p: called before each item's compute with the rows each of :attr:`attention_peers` sent in it (one
    #: expert computation over all of them; an item whose rows are all 0 computes nothing).
    on_rows: Callable[[WorkItem, Sequence[int]], None] | None = None
    #: camp2p: ``stage_token_counts(item)``, the tokens each Attention rank sends in ``item``.
    stage_token_counts: Callable[[WorkItem], Sequence[int]] | None = None
    #: camp2p: the HCCL expert-parallel group of the FFN ranks (optional).
    ffn_ep_group: str | None = None


def role_context(config: AfdConfig, /, **objects: Any) -> AttentionContext | FfnContext:
    """The typed context of ``config.role`` with ``objects`` in the fields of their names (the others in
    ``extras``): for an owner whose role is a variable.  An owner that knows its role builds
    :class:`AttentionContext` / :class:`FfnContext` directly."""
    cls: type[AttentionContext | FfnContext] = AttentionContext if config.role == ATTENTION else FfnContext
    names = {f.name for f in fields(cls)} - {"config", "extras"}
    extras = dict(objects.pop("extras", None) or {})
    extras |= {name: objects.pop(name) for name in list(objects) if name not in names}
    return cls(config=config, extras=extras, **objects)


def _deprecated(old: str, new: str) -> None:
    warnings.warn(f"{old} is deprecated since hook API 2: use {new}", DeprecationWarning, stacklevel=3)


@dataclass
class Plugins:
    """A plugin manager with one connector and its observers registered."""

    manager: pluggy.PluginManager
    connector_name: str
    connector: object
    observers: dict[str, object]
    #: the hook API version each registered plugin was written for, by registered name
    api_versions: dict[str, int] = field(default_factory=dict)

    @property
    def legacy_slots(self) -> bool:
        """True when a registered plugin was written for hook API 0: the executor then gives
        it API 0's buffer lifetimes (an item's input slot is held until its send completed)."""
        return any(version == 0 for version in self.api_versions.values())

    @property
    def hook(self) -> pluggy.HookRelay:
        return self.manager.hook

    def create_streams(
        self, backend: DeviceBackend, roles: tuple[str, ...], config: MultistreamConfig
    ) -> dict[str, Stream]:
        """Call the ``create_streams`` hook and check it returned exactly ``roles``."""
        streams = self.manager.hook.create_streams(backend=backend, roles=roles, config=config)
        if not isinstance(streams, dict) or set(streams) != set(roles):
            raise PluginError(
                f"create_streams returned {streams!r}; expected a dict with exactly the keys {', '.join(roles)}"
            )
        return streams


def new_manager() -> pluggy.PluginManager:
    """A plugin manager with the hook specs and the default ``create_streams``."""
    manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    manager.add_hookspecs(hookspecs)
    manager.register(DefaultStreams(), name="afd_mrv2.default_streams")
    return manager


def entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    """Installed entry points of the ``afd_mrv2`` group, by name."""
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def classify(factory: object) -> str:
    """``connector`` or ``observer``, from the hook implementations ``factory`` declares."""
    probe = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    plain: set[str] = set()
    wrappers: set[str] = set()
    for name in HOOK_NAMES:
        opts = probe.parse_hookimpl_opts(factory, name)
        if opts is None:
            continue
        (wrappers if opts.get("wrapper") or opts.get("hookwrapper") else plain).add(name)
    phases = plain & set(PHASE_HOOKS)
    if phases == set(PHASE_HOOKS):
        return "connector"
    if phases:
        raise PluginError(
            f"{_describe(factory)} implements {', '.join(sorted(phases))} but not all of "
            f"{', '.join(PHASE_HOOKS)}: a connector implements all three phase hooks, "
            "an observer implements them only as wrappers"
        )
    return "observer"


def installed() -> dict[str, str]:
    """Every installed plugin name -> ``connector``, ``observer`` or a load error."""
    found = {}
    for name, ep in sorted(entry_points().items()):
        try:
            found[name] = classify(ep.load())
        except Exception as exc:  # noqa: BLE001 - listing must survive one broken plugin
            found[name] = f"broken ({type(exc).__name__}: {exc})"
    return found


def load_plugins(config: AfdConfig | ConnectorContext, *, resources: Mapping[str, Any] | None = None) -> Plugins:
    """Register the connector ``afd.connector`` and the observers ``afd.observers``.

    ``config``: the role's context (an :class:`AttentionContext` or :class:`FfnContext`, which carries
    the parsed ``afd`` section), handed to every factory; or the ``afd`` section alone, for plugins
    that need no runtime object.  ``resources`` (deprecated since hook API 2, with a
    ``DeprecationWarning``): hook API 1's form, the runtime objects by name beside the section.

    Raises :class:`PluginError` naming the installed connectors when the requested
    one is not installed, and for a plugin of the wrong kind.
    """
    if isinstance(config, ConnectorContext):
        if resources is not None:
            raise TypeError("load_plugins: pass the runtime objects in the context, not as resources")
        context = config.typed()
    else:
        if resources is not None:
            _deprecated("load_plugins(config, resources=...)", "load_plugins(AttentionContext(...) or FfnContext(...))")
        context = role_context(config, **(resources or {}))
    config = context.config
    points = entry_points()
    # Resolve and check every factory before building any plugin object.
    factories = {name: _factory(points, name, "observer") for name in config.observers}
    connector_factory = _factory(points, config.connector, "connector")
    versions = {f"connector:{config.connector}": api_version("connector", config.connector, connector_factory)}
    versions |= {f"observer:{name}": api_version("observer", name, f) for name, f in factories.items()}
    manager = new_manager()
    connector = connector_factory(context=context)
    manager.register(connector, name=f"connector:{config.connector}")
    observers = {}
    for name, factory in factories.items():
        observers[name] = factory(context=context)
        manager.register(observers[name], name=f"observer:{name}")
    for registered, version in versions.items():
        if version == 0:  # API 0's buffer lifetimes; a later version's deprecated members warn where used
            log.warning(
                "%s was written for hook API %d (it declares no hook_api_version); served through "
                "compatibility shims until they are dropped: see CHANGELOG.md for what to change, "
                "then declare hook_api_version = %d",
                registered.replace(":", " "),
                version,
                HOOK_API_VERSION,
            )
    return Plugins(manager, config.connector, connector, observers, versions)


def package_version() -> str:
    """afd-mrv2's installed version (semantic versioning), or ``0+unknown`` in a source tree without metadata."""
    try:
        return importlib.metadata.version("afd-mrv2")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def check_plugins(config: AfdConfig) -> dict[str, int]:
    """Resolve ``config``'s connector and observers and check their kind and hook API version.

    Loads the entry points (imports the plugins' modules) and builds nothing: the
    pre-flight every entry point runs before any process, stream or link exists.
    Returns the hook API version of each, by ``connector:NAME`` / ``observer:NAME``;
    raises :class:`PluginError` in one line otherwise.
    """
    points = entry_points()
    versions = {}
    for name in config.observers:
        versions[f"observer:{name}"] = api_version("observer", name, _factory(points, name, "observer"))
    factory = _factory(points, config.connector, "connector")
    versions[f"connector:{config.connector}"] = api_version("connector", config.connector, factory)
    return versions


def api_version(kind: str, name: str, factory: object) -> int:
    """The hook API version ``factory`` declares (``hook_api_version``; none: 0), if this package serves it.

    Raises :class:`PluginError` naming the plugin, its version and the served ones otherwise.
    """
    declared = getattr(factory, "hook_api_version", 0)
    if not isinstance(declared, int) or isinstance(declared, bool):
        raise PluginError(f"{kind} {name!r} ({_describe(factory)}): hook_api_version must be an int, got {declared!r}")
    if not OLDEST_SERVED_HOOK_API <= declared <= HOOK_API_VERSION:
        raise PluginError(
            f"{kind} {name!r} ({_describe(factory)}) was written for hook API {declared}; afd-mrv2 {package_version()} "
            f"serves hook API {OLDEST_SERVED_HOOK_API} to {HOOK_API_VERSION}: install a release of the plugin "
            f"written for API {HOOK_API_VERSION}"
            + (", or an afd-mrv2 that serves its version" if declared > HOOK_API_VERSION else "")
        )
    return declared


def plugins_for(connector: object, *, observers: Mapping[str, object] | None = None, name: str = "custom") -> Plugins:
    """Register already-built plugin objects (checked like entry-point ones).

    For applications that construct their connector themselves, and for tests.
    """
    if classify(connector) != "connector":
        raise PluginError(f"{_describe(type(connector))} does not implement the phase hooks of a connector")
    versions = {f"connector:{name}": api_version("connector", name, type(connector))}
    manager = new_manager()
    manager.register(connector, name=f"connector:{name}")
    for observer_name, observer in (observers or {}).items():
        if classify(observer) != "observer":
            raise PluginError(f"observer {observer_name!r} implements phase hooks as a connector would")
        versions[f"observer:{observer_name}"] = api_version("observer", observer_name, type(observer))
        manager.register(observer, name=f"observer:{observer_name}")
    return Plugins(manager, name, connector, dict(observers or {}), versions)


def require_installed(points: Mapping[str, importlib.metadata.EntryPoint], name: str, kind: str, *, key: str) -> None:
    """Raise :class:`PluginError` naming ``key`` and the installed plugins of ``kind`` unless ``name`` is installed."""
    if name not in points:
        available = [n for n, k in installed().items() if k == kind]
        raise PluginError(
            f"{key}: {kind} {name!r} is not installed (entry-point group {ENTRY_POINT_GROUP!r}); "
            f"installed {kind}s: {', '.join(available) or 'none'}"
        )


def _factory(points: dict[str, importlib.metadata.EntryPoint], name: str, kind: str) -> Any:
    require_installed(points, name, kind, key="afd.connector" if kind == "connector" else "afd.observers")
    try:
        factory = points[name].load()
    except Exception as exc:
        raise PluginError(f"{kind} {name!r} failed to load from {points[name].value!r}: {exc}") from exc
    actual = classify(factory)
    if actual != kind:
        raise PluginError(f"{name!r} is installed as {actual}, not as {kind}; check afd.connector / afd.observers")
    if isinstance(factory, types.ModuleType) or not callable(factory):
        raise PluginError(f"{kind} {name!r}: entry point {points[name].value!r} must name a class or factory")
    return factory


def _describe(obj: object) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}"
