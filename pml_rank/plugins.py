"""The plugin wiring, all in one place: hookspecs, the registry built from every
installed plugin, and `install()`, which exposes registered components in PML's own
namespaces.

A plugin is any module named by an entry point in the group ``pml_rank``. It implements
one or more of the hooks below, each returning a list of classes::

    # pyproject.toml of the plugin distribution
    [project.entry-points.pml_rank]
    my_losses = "my_package.pml_rank_plugin"

    # my_package/pml_rank_plugin.py
    import pml_rank

    @pml_rank.hookimpl
    def pml_rank_losses():
        return [MyLoss]

pml-rank's own components are registered by ``pml_rank.builtin`` through the same
entry-point group.

A plugin may also declare the hyperparameter search space of its losses for
`pml-rank tune`, as ``{loss name: space}`` where ``space(trial)`` asks an Optuna trial for
values (``trial.suggest_float`` and friends) and returns the loss's constructor keywords;
pml-rank itself needs no Optuna for this::

    @pml_rank.hookimpl
    def pml_rank_search_spaces():
        return {"MyLoss": lambda trial: {"margin": trial.suggest_float("margin", 0.0, 1.0)}}
"""

import dataclasses
import importlib
import warnings
from importlib.metadata import entry_points

import pluggy
import torch
from pytorch_metric_learning.losses import BaseMetricLossFunction
from pytorch_metric_learning.miners import BaseMiner

PROJECT = "pml_rank"
ENTRY_POINT_GROUP = "pml_rank"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class HookSpecs:
    """What a pml-rank plugin may implement. Each hook returns a list of classes."""

    @hookspec
    def pml_rank_losses(self):
        """Loss classes: subclasses of ``pytorch_metric_learning.losses.BaseMetricLossFunction``."""

    @hookspec
    def pml_rank_miners(self):
        """Miner classes: subclasses of ``pytorch_metric_learning.miners.BaseMiner``."""

    @hookspec
    def pml_rank_samplers(self):
        """Sampler classes: subclasses of ``torch.utils.data.Sampler``."""

    @hookspec
    def pml_rank_search_spaces(self):
        """Search spaces for `pml-rank tune`: a dict ``{loss name: space}``, where
        ``space(trial)`` suggests values on an Optuna trial (``trial.suggest_float(name,
        low, high, log=...)``, ``suggest_int``, ``suggest_categorical``) and returns the
        keyword arguments of the loss's constructor. Not a list of classes, unlike the
        hooks above."""


@dataclasses.dataclass(frozen=True)
class Kind:
    name: str  # "losses", as in the hook name and PML's module name
    singular: str
    base: type
    namespace: str  # the PML module that install() extends

    @property
    def hook_name(self):
        return f"pml_rank_{self.name}"


KINDS = {
    kind.name: kind
    for kind in (
        Kind("losses", "loss", BaseMetricLossFunction, "pytorch_metric_learning.losses"),
        Kind("miners", "miner", BaseMiner, "pytorch_metric_learning.miners"),
        Kind("samplers", "sampler", torch.utils.data.Sampler, "pytorch_metric_learning.samplers"),
    )
}


@dataclasses.dataclass(frozen=True)
class Component:
    name: str
    kind: str
    cls: type
    distribution: str
    entry_point: str

    @property
    def source(self):
        return f"distribution {self.distribution!r}, entry point {self.entry_point!r}"


class PluginWarning(UserWarning):
    """A plugin could not be loaded, or returned something that is not a component."""


class NameClashWarning(UserWarning):
    """install() left a name alone because PML already defines it, and installed the class
    under its alias instead (or left the alias too, when another class holds it; see
    `install`). Once per clash and process."""


class PluginConflictError(RuntimeError):
    """Two plugins register components of the same kind under the same name."""


class Registry:
    """Every component of every installed plugin, built-ins included.

    Built lazily on first use and cached; ``reload()`` rebuilds it (after installing
    or removing a plugin distribution in a running process).
    """

    def __init__(self):
        self._components = None
        self._search_spaces = None
        self.plugin_manager = None

    def reload(self):
        self._components = None
        self._search_spaces = None
        self.plugin_manager = None
        self._load()

    def components(self):
        """All components as a list of `Component`, sorted by kind and name."""
        self._load()
        return sorted(self._components.values(), key=lambda c: (c.kind, c.name))

    def losses(self):
        return self._of_kind("losses")

    def miners(self):
        return self._of_kind("miners")

    def samplers(self):
        return self._of_kind("samplers")

    def search_spaces(self):
        """``{loss name: space}`` from every plugin's ``pml_rank_search_spaces()`` hook;
        ``space(trial)`` returns the loss's constructor keywords (see `HookSpecs`)."""
        self._load()
        return {name: space for name, (space, _) in sorted(self._search_spaces.items())}

    def _of_kind(self, kind):
        return {c.name: c.cls for c in self.components() if c.kind == kind}

    def _load(self):
        if self._components is not None:
            return
        manager = pluggy.PluginManager(PROJECT)
        manager.add_hookspecs(HookSpecs)
        components, spaces = {}, {}
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            where = _describe(ep)
            plugin = _load_plugin(manager, ep, where)
            if plugin is None:
                continue
            for kind in KINDS.values():
                for component in _call_hooks(manager, plugin, kind, ep, where):
                    key = (component.kind, component.name)
                    other = components.get(key)
                    if other is not None and other.cls is not component.cls:
                        raise PluginConflictError(
                            f"pml-rank: two plugins register the {kind.singular} "
                            f"{component.name!r}: {other.source} ({_qualname(other.cls)}) "
                            f"and {component.source} ({_qualname(component.cls)}). "
                            "Uninstall one of the two distributions."
                        )
                    components.setdefault(key, component)
            for name, space in _call_search_space_hooks(manager, plugin, where):
                other = spaces.get(name)
                if other is not None and other[0] is not space:
                    dist, entry_point = other[1]
                    raise PluginConflictError(
                        f"pml-rank: two plugins declare the search space of {name!r}: distribution "
                        f"{dist!r}, entry point {entry_point!r} and distribution {where[0]!r}, entry point "
                        f"{where[1]!r}. Uninstall one of the two distributions."
                    )
                spaces.setdefault(name, (space, where))
        self._components = components
        self._search_spaces = spaces
        self.plugin_manager = manager


def _describe(ep):
    dist = ep.dist.name if ep.dist is not None else "<unknown distribution>"
    return dist, f"{ep.name} = {ep.value}"


def _warn(where, problem):
    dist, entry_point = where
    warnings.warn(
        f"pml-rank: plugin from distribution {dist!r}, entry point {entry_point!r}: "
        f"{problem}; its other components and all other plugins still load",
        PluginWarning,
        stacklevel=4,
    )


def _load_plugin(manager, ep, where):
    try:
        plugin = ep.load()
    except Exception as error:  # a broken plugin must not break the others
        _warn(where, f"import failed ({type(error).__name__}: {error}), skipped")
        return None
    try:
        manager.register(plugin, name=f"{where[0]}:{ep.name}")
        manager.check_pending()  # a hookimpl for a hook we do not define (a typo)
    except Exception as error:
        if manager.is_registered(plugin):
            manager.unregister(plugin)
        _warn(where, f"rejected by pluggy ({type(error).__name__}: {error}), skipped")
        return None
    return plugin


def _call_hooks(manager, plugin, kind, ep, where):
    hook = getattr(manager.hook, kind.hook_name)
    for impl in hook.get_hookimpls():
        if impl.plugin is not plugin:
            continue
        try:
            returned = impl.function()
        except Exception as error:
            _warn(where, f"{kind.hook_name}() raised {type(error).__name__}: {error}")
            continue
        if not isinstance(returned, (list, tuple)):
            _warn(where, f"{kind.hook_name}() returned {returned!r}, not a list of classes")
            continue
        for cls in returned:
            if not (isinstance(cls, type) and issubclass(cls, kind.base)):
                _warn(
                    where,
                    f"{kind.hook_name}() returned {cls!r}, which is not a subclass of "
                    f"{_qualname(kind.base)}; that entry is skipped",
                )
                continue
            yield Component(cls.__name__, kind.name, cls, where[0], where[1])


def _call_search_space_hooks(manager, plugin, where):
    hook_name = "pml_rank_search_spaces"
    for impl in getattr(manager.hook, hook_name).get_hookimpls():
        if impl.plugin is not plugin:
            continue
        try:
            returned = impl.function()
        except Exception as error:
            _warn(where, f"{hook_name}() raised {type(error).__name__}: {error}")
            continue
        if not isinstance(returned, dict):
            _warn(where, f"{hook_name}() returned {returned!r}, not a dict {{loss name: space(trial)}}")
            continue
        for name, space in returned.items():
            if not isinstance(name, str) or not callable(space):
                _warn(
                    where,
                    f"{hook_name}() returned the entry {name!r}: {space!r}; a loss name (str) "
                    "mapped to a callable space(trial) was expected; that entry is skipped",
                )
                continue
            yield name, space


def _qualname(cls):
    return f"{cls.__module__}.{cls.__qualname__}"


registry = Registry()

# install() puts a component whose name PML already uses under this prefix + its name.
ALIAS_PREFIX = "PMLRank"

# pml-rank's versions of PML classes, (kind, module, name): not plugin components (they make no
# bench row and have no search space), but a pipeline that builds them by name must get ours.
LIBRARY_CLASSES = [
    ("losses", "pml_rank.losses", "CrossBatchMemory"),
    ("samplers", "pml_rank.samplers", "HierarchicalBatchSampler"),
]

# (alias, class held there, class refused) already reported by install() in this process.
_reported_held_aliases = set()


@dataclasses.dataclass(frozen=True)
class _Installable:
    name: str
    kind: str
    cls: type
    origin: str  # where it comes from, for the warning
    reachable: str  # where it stays reachable when PML's name is taken


def _installables():
    for c in registry.components():
        yield _Installable(c.name, c.kind, c.cls, f"from {c.source}", f"pml_rank.registry.{c.kind}()[{c.name!r}]")
    for kind, module_name, name in LIBRARY_CLASSES:
        cls = getattr(importlib.import_module(module_name), name)
        yield _Installable(name, kind, cls, "from pml-rank", f"{module_name}.{name}")


def install():
    """Make every registered component, and pml-rank's versions of PML classes
    (`LIBRARY_CLASSES`), reachable from PML's own namespaces.

    After ``pml_rank.install()``, ``pytorch_metric_learning.losses.AUCLoss`` is
    pml-rank's ``AUCLoss``, so pipelines that look classes up by name in PML's modules
    find it. A name PML (or anything else) already defines is never replaced: the class
    is installed under its alias, ``"PMLRank" + name`` (pml-rank's FastAP is
    ``pytorch_metric_learning.losses.PMLRankFastAPLoss``, its cross-batch memory
    ``PMLRankCrossBatchMemory``), and a `NameClashWarning` says so. An alias held by another
    class is left to it, with a warning. Each clash warns once per process: calling
    ``install()`` again installs nothing new and stays quiet. Every component also stays
    reachable through ``pml_rank.registry``.

    Returns ``{"installed": [...], "clashes": [...]}`` with dotted names; an alias
    installed for a clash is among the installed names.
    """
    report = {"installed": [], "clashes": []}
    for item in _installables():
        namespace = KINDS[item.kind].namespace
        module = importlib.import_module(namespace)
        dotted = f"{namespace}.{item.name}"
        existing = getattr(module, item.name, None)
        if existing is item.cls:
            continue
        if existing is None:
            setattr(module, item.name, item.cls)
            report["installed"].append(dotted)
            continue
        report["clashes"].append(dotted)
        alias = ALIAS_PREFIX + item.name
        taken = getattr(module, alias, None)
        if taken is item.cls:  # installed by an earlier call, which warned
            continue
        if taken is None:
            setattr(module, alias, item.cls)
            report["installed"].append(f"{namespace}.{alias}")
            where = f"installed as {namespace}.{alias} instead"
        else:
            held = (f"{namespace}.{alias}", taken, item.cls)
            if held in _reported_held_aliases:
                continue
            _reported_held_aliases.add(held)
            where = f"not installed ({namespace}.{alias} is {_qualname(taken)} too)"
        warnings.warn(
            f"pml-rank: {dotted} already exists ({_qualname(existing)}); {_qualname(item.cls)} {item.origin} "
            f"is {where}. Also: {item.reachable}.",
            NameClashWarning,
            stacklevel=2,
        )
    return report
