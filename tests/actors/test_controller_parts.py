"""The controller serves the interfaces its parts are written against (MetadataHost, MoveHost, TopicAdminHost, NodeHost, GroupHost, TransactionHost).

The parts call the controller only through these Protocols; a member the
controller lacks, or has with other parameters or as a plain function where
a coroutine is expected, would fail only when that path runs. Static: the
classes are inspected, no actor is started.
"""

from __future__ import annotations

import inspect

import pytest

from logbus.actors.cluster_nodes import NodeHost
from logbus.actors.controller import Controller
from logbus.actors.group_service import GroupHost
from logbus.actors.metadata_host import MetadataHost
from logbus.actors.replica_moves import MoveHost
from logbus.actors.topic_admin import TopicAdminHost
from logbus.actors.transaction_service import TransactionHost

HOSTS = [MetadataHost, MoveHost, TopicAdminHost, NodeHost, GroupHost, TransactionHost]


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
