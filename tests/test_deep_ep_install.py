"""The install step of ``ep_runtime.deep_ep``: ``python -m ep_runtime deep-ep install`` makes ``import
deep_ep`` give the layer in every new process of the Python that reads the site directory it
wrote into, without touching an engine's code; ``uninstall`` undoes it; a real DeepEP installed
beside it is named (refused, or shadowed with a warning at each import); ``activate`` does it in
one process and refuses a process that already imported a real DeepEP.

Each case installs into a temporary site directory and checks fresh Python processes: ones that
read it at start-up (``site.addsitedir``, what Python does for site-packages), and workers that
a job starts (multiprocessing's spawn: fresh interpreters reading the same site directories
through a ``sitecustomize``, as torchrun and mpirun workers read site-packages).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: What a child prints about ``deep_ep`` once imported.
PROBE = ("import deep_ep, deep_ep.utils, ep_runtime.deep_ep as layer; "
         "from deep_ep import Buffer, Config, EventOverlap; from deep_ep.utils import EventHandle; "
         "print(deep_ep.__name__, deep_ep is layer, Buffer is layer.Buffer, deep_ep.utils.__name__)")


def _env(*paths) -> dict:
    """The children's environment: this worktree first (and ``paths``) on PYTHONPATH."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join([*map(str, paths), str(ROOT)]))


def _cli(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ep_runtime", "deep-ep", *args], env=env or _env(),
                          capture_output=True, text=True, timeout=120)


def _python(code: str, site: Path, env=None) -> subprocess.CompletedProcess:
    """A fresh Python that reads ``site`` as a site directory, running ``code``."""
    return subprocess.run([sys.executable, "-c", f"import site; site.addsitedir({str(site)!r})\n{code}"],
                          env=env or _env(), capture_output=True, text=True, timeout=300)


def _fake_deep_ep(tmp_path: Path) -> Path:
    """A directory holding a package named ``deep_ep`` (a stand-in for the real DeepEP)."""
    pkg = tmp_path / "real" / "deep_ep"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("REAL = True\n")
    return pkg.parent


def test_install_makes_import_deep_ep_give_the_layer_in_new_processes(tmp_path):
    site = tmp_path / "site"
    done = _cli("install", "--site", str(site))
    assert done.returncode == 0, done.stderr
    assert {p.name for p in site.iterdir()} == {"ep_runtime_deep_ep.pth", "_ep_runtime_deep_ep.py"}
    got = _python(PROBE, site)
    assert got.returncode == 0, got.stderr
    assert got.stdout.split() == ["ep_runtime.integrations.deep_ep", "True", "True",
                                  "ep_runtime.integrations.deep_ep.utils"], got.stdout
    assert "shadowed" not in got.stderr
    without = subprocess.run([sys.executable, "-c", "import deep_ep"], env=_env(), capture_output=True, text=True)
    assert "No module named 'deep_ep'" in without.stderr, "a process that does not read the site directory"


def test_workers_a_job_starts_get_the_alias(tmp_path):
    site, boot = tmp_path / "site", tmp_path / "boot"
    assert _cli("install", "--site", str(site)).returncode == 0
    boot.mkdir()
    (boot / "sitecustomize.py").write_text(f"import site\nsite.addsitedir({str(site)!r})\n")
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import multiprocessing as mp

        def worker(q):
            import deep_ep
            q.put((deep_ep.__name__, deep_ep.Buffer.__module__))

        if __name__ == "__main__":
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            procs = [ctx.Process(target=worker, args=(q,)) for _ in range(2)]
            for p in procs:
                p.start()
            print(sorted(q.get(timeout=240) for _ in procs))
            for p in procs:
                p.join()
    """))
    got = subprocess.run([sys.executable, str(script)], env=_env(boot), capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr
    name = ("ep_runtime.integrations.deep_ep", "ep_runtime.integrations.deep_ep.buffer")
    assert got.stdout.strip() == str([name, name]), got.stdout


def test_a_real_deep_ep_is_named_refused_or_shadowed_with_a_warning(tmp_path):
    real = _fake_deep_ep(tmp_path)
    site = tmp_path / "site"
    refused = _cli("install", "--site", str(site), env=_env(real))
    assert refused.returncode == 2 and not site.exists()
    assert str(real / "deep_ep") in refused.stderr and "--shadow" in refused.stderr, refused.stderr
    shadowing = _cli("install", "--site", str(site), "--shadow", env=_env(real))
    assert shadowing.returncode == 0, shadowing.stderr
    got = _python(PROBE, site, env=_env(real))
    assert got.returncode == 0 and got.stdout.split()[:3] == ["ep_runtime.integrations.deep_ep", "True", "True"]
    assert "shadowed" in got.stderr and str(real / "deep_ep") in got.stderr and "uninstall" in got.stderr, got.stderr


def test_uninstall_removes_the_alias_and_a_real_deep_ep_comes_back(tmp_path):
    real = _fake_deep_ep(tmp_path)
    site = tmp_path / "site"
    assert _cli("install", "--site", str(site), "--shadow", env=_env(real)).returncode == 0
    status = _cli("status", "--site", str(site), env=_env(real))
    assert "installed: True" in status.stdout and str(real / "deep_ep") in status.stdout, status.stdout
    removed = _cli("uninstall", "--site", str(site))
    assert removed.returncode == 0 and removed.stdout.count("removed") == 2 and not any(site.iterdir())
    got = _python("import deep_ep; print(getattr(deep_ep, 'REAL', False))", site, env=_env(real))
    assert got.stdout.strip() == "True", got.stderr
    assert "installed: False" in _cli("status", "--site", str(site)).stdout
    assert _cli("uninstall", "--site", str(site)).stdout.strip() == "nothing to remove"


def test_an_alias_left_without_ep_runtime_names_both_ways_out(tmp_path):
    site = tmp_path / "site"
    assert _cli("install", "--site", str(site)).returncode == 0
    got = _python("import sys; sys.modules['ep_runtime'] = None\nimport deep_ep", site)
    assert got.returncode != 0
    assert "ep_runtime cannot be imported" in got.stderr and "deep-ep uninstall" in got.stderr, got.stderr


def test_activate_in_one_process_and_refused_after_a_real_deep_ep_is_imported(monkeypatch):
    pytest.importorskip("torch")
    from ep_runtime.integrations.deep_ep import alias

    monkeypatch.setitem(sys.modules, "deep_ep", types.ModuleType("deep_ep"))
    with pytest.raises(alias.DeepEPAliasError, match="already imported"):
        alias.activate()
    monkeypatch.delitem(sys.modules, "deep_ep")
    alias.activate()
    try:
        import deep_ep
        import ep_runtime.deep_ep

        assert deep_ep is ep_runtime.deep_ep and alias.status()["active"]
    finally:
        alias.deactivate()
    assert "deep_ep" not in sys.modules and not alias.status()["active"]


def test_megatron_core_s_fused_a2a_finds_the_layer(tmp_path):
    pytest.importorskip("megatron.core")
    site = tmp_path / "site"
    assert _cli("install", "--site", str(site)).returncode == 0
    got = _python("import ep_runtime.deep_ep as layer\nfrom megatron.core.transformer.moe import fused_a2a as f\n"
                  "print(f.HAVE_DEEP_EP, f.Buffer is layer.Buffer, f.EventOverlap is layer.EventOverlap)", site)
    assert got.returncode == 0, got.stderr
    assert got.stdout.split() == ["True", "True", "True"], got.stdout
