"""The controller serves the interfaces its parts are written against (MetadataHost, MoveHost, TopicAdminHost, NodeHost, ClientHost, GroupHost, TransactionHost).

The parts call the controller only through these Protocols; a member the
controller lacks, or has with other parameters or as a plain function where
a coroutine is expected, would fail only when that path runs. Static: the
classes are inspected, no actor is started.
"""

from __future__ import annotations

import ast
import inspect

import pytest

from logbus.actors.client_metadata import ClientHost, ClientMetadata
from logbus.actors.cluster_nodes import ClusterNodes, NodeHost
from logbus.actors.controller import Controller
from logbus.actors.group_service import GroupHost
from logbus.actors.metadata_host import MetadataHost
from logbus.actors.replica_moves import MoveHost
from logbus.actors.topic_admin import TopicAdminHost
from logbus.actors.transaction_service import TransactionHost

HOSTS = [MetadataHost, MoveHost, TopicAdminHost, NodeHost, ClientHost, GroupHost, TransactionHost]


def members(protocol) -> dict[str, object]:
    return {name: value for name, value in vars(protocol).items() if not name.startswith("_")}


@pytest.mark.parametrize("protocol", HOSTS, ids=lambda p: p.__name__)
def test_the_controller_has_every_member_of_each_host_interface_with_its_parameters(protocol):
    for name, wanted in members(protocol).items():
        found = inspect.getattr_static(Controller, name, None)
        assert found is not None, f"Controller lacks {protocol.__name__}.{name}"
        if isinstance(wanted, property):
            assert isinstance(found, property), f"Controller.{name} must be a property"
            continue
        assert inspect.iscoroutinefunction(found) == inspect.iscoroutinefunction(wanted), f"Controller.{name}: async or not as {protocol.__name__}"
        expected = list(inspect.signature(wanted).parameters)
        actual = inspect.signature(found).parameters
        assert list(actual)[: len(expected)] == expected, f"Controller.{name}{inspect.signature(found)} vs {inspect.signature(wanted)}"
        extra = list(actual.values())[len(expected):]
        assert all(p.default is not inspect.Parameter.empty for p in extra), f"Controller.{name}: its extra parameters need defaults"
    for name in getattr(protocol, "__annotations__", {}):
        assert f"self.{name} = " in inspect.getsource(Controller.__init__), f"Controller sets no {name}"


def host_members_used(part: type) -> set[str]:
    """The attributes a part's source reads of its host: ``self._host.X``, or ``host.X`` after ``host = self._host``."""
    used = set()
    for node in ast.walk(ast.parse(inspect.getsource(part))):
        if isinstance(node, ast.Attribute):
            base = node.value
            if isinstance(base, ast.Name) and base.id == "host":
                used.add(node.attr)
            elif isinstance(base, ast.Attribute) and base.attr == "_host" and isinstance(base.value, ast.Name) and base.value.id == "self":
                used.add(node.attr)
    return used


def protocol_members(protocol) -> set[str]:
    found = set()
    for cls in protocol.__mro__:
        if cls is object:
            continue
        found |= {name for name in vars(cls) if not name.startswith("_")} | set(getattr(cls, "__annotations__", {}))
    return found


@pytest.mark.parametrize(("part", "protocol"), [(ClusterNodes, NodeHost), (ClientMetadata, ClientHost)], ids=lambda p: p.__name__)
def test_a_part_reaches_the_controller_only_through_its_host_interface(part, protocol):
    used = host_members_used(part)
    assert used, f"no use of the host found in {part.__name__}"
    assert used <= protocol_members(protocol), f"{part.__name__} uses {sorted(used - protocol_members(protocol))} outside {protocol.__name__}"
