"""Test ordering: the compile-and-link gate first.

tests/test_compile_gate.py is the suite's longest file (one compile of every kernel, minutes on a
2-core CI machine, in two processes). With one xdist worker per core and whole files per worker
(``--dist loadfile``), a file scheduled last runs alone at the end; listed first (and xdist's
reordering by test count off: ``--no-loadscope-reorder`` in pyproject.toml), it runs beside the
rest of the suite.
"""


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.nodeid.split("::")[0] != "tests/test_compile_gate.py")
