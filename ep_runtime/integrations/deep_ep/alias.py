"""``import deep_ep`` gives ep_runtime's layer: the import alias and the install step.

- :func:`activate`: in this process, ``deep_ep`` and ``deep_ep.<sub>`` resolve to
  :mod:`ep_runtime.integrations.deep_ep` and its submodules (an import finder first on
  ``sys.meta_path``): the same module objects under both names.
- :func:`install` (``python -m ep_runtime deep-ep install``): in every process of a Python, from
  start-up: writes ``ep_runtime_deep_ep.pth`` and the small module it loads,
  ``_ep_runtime_deep_ep.py``, into a site directory (default: the running Python's
  site-packages). Python reads ``.pth`` files at start-up, so torchrun, mpirun and
  multiprocessing workers get the alias without any code change; the module imports nothing
  until ``deep_ep`` is imported. :func:`uninstall` removes both files, :func:`status` reports.

A real DeepEP installed alongside is shadowed: :func:`install` refuses unless ``shadow=True``,
and every ``import deep_ep`` through the alias then warns, naming the shadowed package. A real
DeepEP already imported in a process keeps that process: :func:`activate` raises.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import sysconfig
import warnings
from pathlib import Path

from ep_runtime.core.errors import EPStateError

#: The name engines import, and the package it resolves to.
ALIAS, TARGET = "deep_ep", "ep_runtime.integrations.deep_ep"
#: The files the install step writes into a site directory.
PTH_FILE, HOOK_MODULE = "ep_runtime_deep_ep.pth", "_ep_runtime_deep_ep"
#: What the ``.pth`` file holds (a line Python executes at start-up).
PTH_LINE = f"import {HOOK_MODULE}; {HOOK_MODULE}.install()\n"
#: The module the ``.pth`` file loads: a finder that imports ep_runtime only when ``deep_ep`` is.
HOOK_SOURCE = f'''"""Written by `python -m ep_runtime deep-ep install`; `python -m ep_runtime deep-ep uninstall`
removes it. Makes `import deep_ep` give ep_runtime's DeepEP layer (ep_runtime.deep_ep) in every
process of this Python: {PTH_FILE} calls install() at start-up. Imports nothing until a
module named deep_ep is imported."""
import sys


class _DeepEPAlias:
    """Finds `deep_ep` and `deep_ep.*` through ep_runtime's alias finder (imported on first use)."""

    @staticmethod
    def find_spec(fullname, path=None, target=None):
        if fullname != "{ALIAS}" and not fullname.startswith("{ALIAS}."):
            return None
        try:
            from ep_runtime.integrations.deep_ep.alias import AliasFinder
        except ImportError as exc:
            raise ImportError(f"import {{fullname}}: ep_runtime's DeepEP alias is installed ({{__file__}}) but "
                              f"ep_runtime cannot be imported ({{exc}}); install ep_runtime again, or remove the "
                              f"alias: python -m ep_runtime deep-ep uninstall") from exc
        return AliasFinder().find_spec(fullname, path, target)


def install():
    """Put the finder first on sys.meta_path (once)."""
    if not any(type(f).__name__ == "_DeepEPAlias" for f in sys.meta_path):
        sys.meta_path.insert(0, _DeepEPAlias())
'''


class DeepEPAliasError(EPStateError):
    """The alias cannot take effect: a real DeepEP is installed (install without ``shadow``) or
    already imported in this process (:func:`activate`)."""


class _AliasLoader(importlib.abc.Loader):
    """Loads ``deep_ep[.sub]`` as the already importable ``ep_runtime.integrations.deep_ep[.sub]``."""

    def __init__(self, real: str):
        self.real = real

    def create_module(self, spec):
        return importlib.import_module(self.real)

    def exec_module(self, module) -> None:
        """Nothing: the real module ran when it was imported."""


class AliasFinder(importlib.abc.MetaPathFinder):
    """``deep_ep`` and ``deep_ep.<sub>`` as ep_runtime's layer (see the module docstring)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != ALIAS and not fullname.startswith(ALIAS + "."):
            return None
        real = TARGET + fullname[len(ALIAS):]
        if importlib.util.find_spec(real) is None:
            return None
        if fullname == ALIAS:
            shadowed = real_deep_ep()
            if shadowed is not None:
                warnings.warn(f"import deep_ep gives ep_runtime's DeepEP layer (ep_runtime.deep_ep); the DeepEP "
                              f"installed at {shadowed} is shadowed. `python -m ep_runtime deep-ep uninstall` "
                              f"restores it.", stacklevel=2)
        return importlib.util.spec_from_loader(fullname, _AliasLoader(real), is_package=fullname == ALIAS)


def real_deep_ep() -> str | None:
    """Where a real DeepEP package is installed on ``sys.path`` (its origin), or None."""
    spec = importlib.machinery.PathFinder.find_spec(ALIAS)
    if spec is None:
        return None
    return spec.origin or str(list(spec.submodule_search_locations or [])[:1])


def activate() -> None:
    """Make ``import deep_ep`` give the layer in this process (idempotent). Raises
    :class:`DeepEPAliasError` when a module named ``deep_ep`` other than the layer is already
    imported (import ep_runtime's alias before the engine imports DeepEP, or use the install step)."""
    imported = sys.modules.get(ALIAS)
    if imported is not None and not getattr(imported, "ep_runtime_layer", False):
        raise DeepEPAliasError(f"activate: a DeepEP is already imported in this process "
                               f"({getattr(imported, '__file__', imported)}); activate the alias before anything "
                               f"imports deep_ep, or install it for every process: python -m ep_runtime deep-ep "
                               f"install")
    if not any(isinstance(f, AliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, AliasFinder())


def deactivate() -> None:
    """Undo :func:`activate` in this process (and forget ``deep_ep`` modules imported through it)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, AliasFinder)]
    for name in [n for n in sys.modules if n == ALIAS or n.startswith(ALIAS + ".")]:
        if getattr(sys.modules[name], "__name__", "").startswith(TARGET):
            del sys.modules[name]


def default_site() -> Path:
    """The running Python's site-packages (where pip puts the packages it installs)."""
    return Path(sysconfig.get_paths()["purelib"])


def install(site: str | Path | None = None, shadow: bool = False) -> list[Path]:
    """Write the alias into ``site`` (default: :func:`default_site`): ``import deep_ep`` then gives
    the layer in every process that reads that directory's ``.pth`` files at start-up. Returns
    the files written. Raises :class:`DeepEPAliasError` when a real DeepEP is importable, unless
    ``shadow`` (it is then hidden, with a warning at each ``import deep_ep``)."""
    site = Path(site) if site is not None else default_site()
    shadowed = real_deep_ep()
    if shadowed is not None and not shadow:
        raise DeepEPAliasError(f"install: a DeepEP is installed at {shadowed}; `import deep_ep` would give it or, "
                               f"with the alias, hide it. Uninstall it (pip uninstall deep_ep), or pass --shadow "
                               f"to hide it (each import then warns).")
    site.mkdir(parents=True, exist_ok=True)
    hook, pth = site / f"{HOOK_MODULE}.py", site / PTH_FILE
    hook.write_text(HOOK_SOURCE)
    pth.write_text(PTH_LINE)
    return [pth, hook]


def uninstall(site: str | Path | None = None) -> list[Path]:
    """Remove the alias's files from ``site`` (default: :func:`default_site`); returns those removed."""
    site = Path(site) if site is not None else default_site()
    removed = []
    for path in (site / PTH_FILE, site / f"{HOOK_MODULE}.py"):
        if path.exists():
            path.unlink()
            removed.append(path)
    return removed


def status(site: str | Path | None = None) -> dict:
    """``{"site", "installed", "real_deep_ep", "active"}``: the site directory, whether both files
    are there, a real DeepEP's location (or None), whether the alias is active in this process."""
    site = Path(site) if site is not None else default_site()
    return {"site": str(site), "installed": (site / PTH_FILE).exists() and (site / f"{HOOK_MODULE}.py").exists(),
            "real_deep_ep": real_deep_ep(),
            "active": any(type(f).__name__ in ("AliasFinder", "_DeepEPAlias") for f in sys.meta_path)}
