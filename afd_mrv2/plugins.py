"""The plugin manager: discovers connectors and observers, registers the chosen ones.

Connectors and observers are found in the ``afd_mrv2`` entry-point group, the
built-in ones exactly like third-party ones.  An entry point names a factory (a
class, usually) called as ``factory(context=ConnectorContext(...))``; the object it
returns is registered with pluggy.  What the object implements decides its kind:

* a **connector** implements ``on_recv``, ``on_compute`` and ``on_send`` as plain
  hook implementations; exactly one connector, chosen by ``afd.connector``, is
  registered per executor, so exactly one connector's phase hooks run per item;
* an **observer** implements phase hooks only as wrappers
  (``@hookimpl(wrapper=True)``), plus any ``on_cleanup``; the ones named in
  ``afd.observers`` are registered around the connector.

Third-party distribution example (``pyproject.toml``)::

    [project.entry-points.afd_mrv2]
    my_link = "my_pkg.connector:MyLinkConnector"
    my_checker = "my_pkg.checks:OrderingObserver"

Versions: the factory declares the hook API version it was written for as the class
attribute ``hook_api_version`` (:data:`afd_mrv2.hookspecs.HOOK_API_VERSION`); none
declared is API 0, served through compatibility shims (:class:`afd_mrv2.work.Work`'s
``slot`` and ``scratch``, with API 0's buffer lifetimes).  A version this package no
longer serves, or does not serve yet, is refused in one line when the plugin is
resolved (:func:`check_plugins`), before any object, stream or link exists.
"""

from __future__ import annotations

import importlib.metadata
import logging
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pluggy

from afd_mrv2 import hookspecs
from afd_mrv2.config import AfdConfig, MultistreamConfig
from afd_mrv2.default_streams import DefaultStreams
from afd_mrv2.devices.base import DeviceBackend, Stream
from afd_mrv2.errors import PluginError
from afd_mrv2.hookspecs import HOOK_API_VERSION, OLDEST_SERVED_HOOK_API

ENTRY_POINT_GROUP = "afd_mrv2"
PHASE_HOOKS = ("on_recv", "on_compute", "on_send")
HOOK_NAMES = ("create_streams", *PHASE_HOOKS, "on_cleanup")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConnectorContext:
    """What a connector or observer factory receives.

    config: the parsed ``afd`` section (``config.extra`` is ``connector_extra_config``).
    resources: runtime objects the embedding application provides, by name.  Keys
    used by afd-mrv2's own runners: ``process_group`` (a torch.distributed group),
    ``rank_map`` (the AFD topology), ``model`` (the model-side spec the connector
    needs for buffer shapes).  A factory must fail with a clear error when a
    resource it needs is missing.
    """

    config: AfdConfig
    resources: Mapping[str, Any] = field(default_factory=dict)

    def resource(self, name: str) -> Any:
        """The named resource, or a :class:`PluginError` saying who must provide it."""
        try:
            return self.resources[name]
        except KeyError:
            raise PluginError(
                f"connector {self.config.connector!r} needs the runtime resource {name!r}, "
                f"which its runner did not provide (provided: {', '.join(sorted(self.resources)) or 'none'})"
            ) from None


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


def load_plugins(config: AfdConfig, *, resources: Mapping[str, Any] | None = None) -> Plugins:
    """Register the connector ``config.connector`` and the observers ``config.observers``.

    Raises :class:`PluginError` naming the installed connectors when the requested
    one is not installed, and for a plugin of the wrong kind.
    """
    context = ConnectorContext(config=config, resources=dict(resources or {}))
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
        if version < HOOK_API_VERSION:
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
