"""The import-structure check (tools/check_structure.py): its rules on small packages written to disk, then logbus itself.

Static analysis only: nothing here imports logbus or Ray.
"""

from __future__ import annotations

import importlib.util
import itertools
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parent.parent
TOOL = REPO / "tools" / "check_structure.py"

_spec = importlib.util.spec_from_file_location("check_structure", TOOL)
cs = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = cs  # dataclasses resolve their module through sys.modules
_spec.loader.exec_module(cs)


def write_package(tmp_path: Path, files: dict[str, str]) -> Path:
    """Write ``{path under logbus/: source}`` to tmp_path/logbus, with an empty __init__.py in every directory lacking one."""
    root = tmp_path / "logbus"
    for rel, source in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source).lstrip("\n"))
    for directory in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        init = directory / "__init__.py"
        if not init.exists():
            init.write_text("")
    return root


def edges(graph) -> set[tuple[str, str]]:
    return {(e.source, e.target) for e in graph.internal}


def by_rule(report, rule: str):
    return [v for v in report.violations if v.rule == rule]


# -- the graph ---------------------------------------------------------------------------------


def test_relative_imports_are_resolved_against_the_importing_modules_package(tmp_path):
    pkg = write_package(tmp_path, {
        "errors.py": "class E(Exception): pass\n",
        "api/__init__.py": "from .client import Bus\n",
        "api/admin.py": "X = 1\n",
        "api/client.py": """
            from . import admin
            from .. import errors
            from ..errors import E

            class Bus:
                def admin(self):
                    from .admin import X
                    return X
        """,
    })
    graph = cs.build_graph(pkg)
    assert edges(graph) == {
        ("logbus.api", "logbus.api.client"),  # in an __init__, "." is the package itself
        ("logbus.api.client", "logbus.api.admin"),
        ("logbus.api.client", "logbus.errors"),
    }
    lines = sorted(e.site.line for e in graph.internal if e.source == "logbus.api.client")
    assert lines == [1, 2, 3, 7]
    assert not graph.unresolved


def test_what_a_from_import_names(tmp_path):
    pkg = write_package(tmp_path, {
        "api/__init__.py": "from logbus.api.client import Bus\n",
        "api/client.py": "class Bus: pass\n",
        "api/dataset.py": "",
        "user.py": """
            import logbus.api.dataset
            from logbus.api import Bus
            from logbus import api
        """,
        "other.py": "from logbus.api import Bus, dataset\n",
    })
    graph = cs.build_graph(pkg)
    assert {(s, t) for s, t in edges(graph) if s == "logbus.user"} == {
        ("logbus.user", "logbus.api.dataset"),  # `import a.b.c` names a.b.c only, no implicit parent edge
        ("logbus.user", "logbus.api"),  # a re-exported name: the package's __init__ ...
    }
    assert ("logbus.api", "logbus.api.client") in edges(graph)  # ... which has the edge to the submodule
    assert {(s, t) for s, t in edges(graph) if s == "logbus.other"} == {
        ("logbus.other", "logbus.api"),
        ("logbus.other", "logbus.api.dataset"),
    }


def test_imports_that_name_no_module_are_reported(tmp_path):
    pkg = write_package(tmp_path, {
        "a.py": """
            def f():
                from logbus.gone import thing
            from ... import above
        """,
    })
    report = cs.check(pkg)
    found = {(v.edge.target, v.edge.site.line) for v in by_rule(report, "unresolved-import")}
    assert found == {("logbus.gone", 2), ("...", 3)}
    assert not report.ok


# -- cycles ------------------------------------------------------------------------------------


def test_a_cycle_through_a_function_level_import_is_found(tmp_path):
    pkg = write_package(tmp_path, {
        "actors/controller.py": """
            from logbus.actors.group_service import GroupService

            class Controller:
                def start(self):
                    from logbus.actors import factory  # factory imports this module
                    return factory
        """,
        "actors/factory.py": "from logbus.actors.controller import Controller\n",
        "actors/group_service.py": """
            class GroupService:
                def nodes(self):
                    from logbus.actors.controller import Controller
        """,
    })
    report = cs.check(pkg)
    cycles = {v.chain: v.hops for v in by_rule(report, "cycle")}
    hop = lambda path, line: (cs.Site(f"logbus/actors/{path}", line, ""),)  # noqa: E731
    assert cycles == {
        ("logbus.actors.controller", "logbus.actors.factory", "logbus.actors.controller"):
            (hop("controller.py", 5), hop("factory.py", 1)),
        ("logbus.actors.controller", "logbus.actors.group_service", "logbus.actors.controller"):
            (hop("controller.py", 1), hop("group_service.py", 3)),
    }
    assert report.violations == by_rule(report, "cycle")


def test_a_cycle_through_a_relative_import_under_type_checking_is_found(tmp_path):
    pkg = write_package(tmp_path, {
        "api/admin.py": "from .client import get\n",
        "api/client.py": """
            from typing import TYPE_CHECKING

            if TYPE_CHECKING:
                from .admin import Admin

            def get(): ...
        """,
    })
    [cycle] = by_rule(cs.check(pkg), "cycle")
    assert cycle.chain == ("logbus.api.admin", "logbus.api.client", "logbus.api.admin")
    assert [[str(s) for s in sites] for sites in cycle.hops] == [["logbus/api/admin.py:1"], ["logbus/api/client.py:4"]]


def test_a_package_init_reexport_closes_a_cycle(tmp_path):
    # consumer imports a name from the api package's namespace; that runs api/__init__, which imports consumer.
    pkg = write_package(tmp_path, {
        "api/__init__.py": "from logbus.api.client import Bus\nfrom logbus.api.consumer import Consumer\n",
        "api/client.py": "class Bus: pass\n",
        "api/consumer.py": "from logbus.api import Bus\n\nclass Consumer: pass\n",
    })
    [cycle] = by_rule(cs.check(pkg), "cycle")
    assert cycle.chain == ("logbus.api", "logbus.api.consumer", "logbus.api")


def test_a_module_importing_itself_is_a_cycle(tmp_path):
    pkg = write_package(tmp_path, {"a.py": "def f():\n    from logbus.a import f\n"})
    [cycle] = by_rule(cs.check(pkg), "cycle")
    assert cycle.chain == ("logbus.a", "logbus.a")


def brute_force_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every ordering of distinct nodes that closes into a cycle, kept once (starting at its smallest node)."""
    out = []
    for k in range(1, len(graph) + 1):
        for perm in itertools.permutations(sorted(graph), k):
            if perm[0] == min(perm) and all(b in graph[a] for a, b in zip(perm, perm[1:] + perm[:1])):
                out.append(list(perm))
    return sorted(out)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 6).flatmap(
    lambda n: st.sets(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=n * n).map(lambda e: (n, e))
))
def test_elementary_cycles_finds_exactly_the_simple_cycles(spec):
    n, pairs = spec
    graph = {f"m{i}": set() for i in range(n)}
    for a, b in pairs:
        graph[f"m{a}"].add(f"m{b}")
    assert cs.elementary_cycles(graph) == brute_force_cycles(graph)


# -- layers ------------------------------------------------------------------------------------


def test_actors_importing_api_is_reported_wherever_the_import_is(tmp_path):
    pkg = write_package(tmp_path, {
        "api/client.py": "def unwrap(x): return x\n",
        "actors/group_service.py": """
            from typing import TYPE_CHECKING

            if TYPE_CHECKING:
                from logbus.api.client import unwrap

            class GroupService:
                def commit(self):
                    from ..api import client
                    return client
        """,
    })
    report = cs.check(pkg)
    found = sorted((str(v.edge.site), v.edge.target) for v in by_rule(report, "actors-imports-api"))
    assert found == [("logbus/actors/group_service.py:4", "logbus.api.client"),
                     ("logbus/actors/group_service.py:8", "logbus.api.client")]
    assert report.violations == by_rule(report, "actors-imports-api")


def test_protocol_importing_ray_inside_a_function_is_reported(tmp_path):
    pkg = write_package(tmp_path, {
        "protocol/coordinator.py": """
            import json

            def gauge():
                from ray.util.metrics import Gauge
                return Gauge

            class Coordinator:
                def get(self):
                    import ray
                    return ray
        """,
        "storage/log.py": "import rayon_is_not_ray\n",
    })
    report = cs.check(pkg)
    found = sorted((str(v.edge.site), v.edge.target) for v in by_rule(report, "bottom-imports-ray"))
    assert found == [("logbus/protocol/coordinator.py:4", "ray.util.metrics"),
                     ("logbus/protocol/coordinator.py:9", "ray")]
    assert report.violations == by_rule(report, "bottom-imports-ray")


def test_storage_and_protocol_importing_actors_or_api_is_reported(tmp_path):
    pkg = write_package(tmp_path, {
        "actors/controller.py": "LIVE = 1\n",
        "api/client.py": "def get(): ...\n",
        "storage/log.py": "def f():\n    from logbus.actors.controller import LIVE\n",
        "protocol/messages.py": "from logbus import api\n",
    })
    report = cs.check(pkg)
    found = sorted((str(v.edge.site), v.edge.target) for v in by_rule(report, "bottom-imports-upper"))
    assert found == [("logbus/protocol/messages.py:1", "logbus.api"),
                     ("logbus/storage/log.py:2", "logbus.actors.controller")]


def test_storage_importing_protocol_is_information_only(tmp_path):
    pkg = write_package(tmp_path, {
        "protocol/messages.py": "class TopicPartition: ...\n",
        "storage/log.py": "from logbus.protocol.messages import TopicPartition\n",
    })
    report = cs.check(pkg)
    assert report.ok
    assert [(str(v.edge.site), v.edge.target) for v in report.info] == [("logbus/storage/log.py:1", "logbus.protocol.messages")]


CLEAN_PACKAGE = {
    # The intended layering: storage <- protocol <- actors <- api <- package root; Ray from actors up.
    "__init__.py": """
        from logbus.api import Bus, connect

        def __getattr__(name):
            from logbus.api import dataset
            return getattr(dataset, name)
    """,
    "errors.py": "class LogbusError(Exception): pass\n",
    "storage/__init__.py": "from logbus.storage.log import PartitionLog\n",
    "storage/log.py": "from logbus.errors import LogbusError\nimport numpy as np\n\nclass PartitionLog: ...\n",
    "protocol/messages.py": "from logbus.storage import PartitionLog\n",
    "actors/controller.py": """
        import ray
        from logbus.protocol.messages import PartitionLog

        def factory():
            from logbus.actors import replica
            return replica
    """,
    "actors/replica.py": "import ray\nfrom ..storage.log import PartitionLog\n",
    "api/__init__.py": "from .client import Bus, connect\n",
    "api/client.py": """
        import ray

        class Bus: ...

        def connect():
            from logbus.actors.controller import factory
            return factory()
    """,
    "api/dataset.py": "from ray.data import Datasource\nfrom logbus.api.client import connect\n",
}


def test_a_clean_package_passes(tmp_path):
    report = cs.check(write_package(tmp_path, CLEAN_PACKAGE))
    assert report.violations == []
    assert report.info == []
    assert len(report.graph.modules) == 12
    assert ("logbus.actors.controller", "logbus.actors.replica") in edges(report.graph)
    assert "OK" in report.render()


def test_a_c_extension_is_a_module_importing_nothing(tmp_path):
    """A module built from C (logbus/api/_fastsend.c) is imported by name like any other; it is a leaf."""
    root = write_package(tmp_path, {
        "api/__init__.py": "from logbus.api.producer import Producer\n",
        "api/producer.py": "from logbus.api import _fast\n\nclass Producer:\n    pass\n",
        "api/_fast.c": "#include <Python.h>\n",
    })
    report = cs.check(root)
    assert report.violations == []
    assert ("logbus.api.producer", "logbus.api._fast") in edges(report.graph)
    assert not any(e.source == "logbus.api._fast" for e in report.graph.internal)


def test_the_command_exits_0_on_a_clean_package(tmp_path):
    pkg = write_package(tmp_path, CLEAN_PACKAGE)
    result = subprocess.run([sys.executable, str(TOOL), str(pkg)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("logbus: 12 modules")
    assert "OK: no import cycles" in result.stdout


def test_the_command_exits_1_listing_each_offending_import(tmp_path):
    pkg = write_package(tmp_path, {
        "api/client.py": "def get(): ...\n",
        "actors/a.py": "from logbus.actors.b import x\n",
        "actors/b.py": "def x():\n    from logbus.actors.a import y\n    from logbus.api.client import get\n",
    })
    result = subprocess.run([sys.executable, str(TOOL), str(pkg)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stdout + result.stderr
    out = result.stdout
    assert "FAIL: 2 violation(s)" in out
    assert "cycle: logbus.actors.a -> logbus.actors.b -> logbus.actors.a" in out
    assert "logbus.actors.a -> logbus.actors.b  at logbus/actors/a.py:1" in out
    assert "logbus.actors.b -> logbus.actors.a  at logbus/actors/b.py:2" in out
    assert "logbus/actors/b.py:3: logbus.actors.b imports logbus.api.client" in out


def test_the_command_rejects_a_directory_that_is_not_a_package(tmp_path):
    result = subprocess.run([sys.executable, str(TOOL), str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "not a package directory" in result.stderr


# -- logbus itself -----------------------------------------------------------------------------


def test_logbus_has_no_import_cycles_and_respects_its_layers():
    report = cs.check(REPO / "logbus")
    assert len(report.graph.modules) > 30  # the real package was found and parsed
    assert report.violations == [], report.render()
