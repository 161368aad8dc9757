"""The ACL authorizer without Ray: Kafka's decision order, implied operations, prefixes, wildcards, filters."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from logbus.errors import InvalidConfigError
from logbus.protocol.acl import AclBinding, AclFilter, Authorizer, Operation, ResourceType

ALICE, BOB = "User:alice", "User:bob"
HOST = "10.0.0.7"


def acl(**fields) -> AclBinding:
    return AclBinding.of({"principal": ALICE, "resource_type": "topic", "name": "orders", **fields})


def may(authorizer: Authorizer, operation: str, name: str = "orders", resource_type: str = "topic", principal: str = ALICE,
        host: str = HOST) -> bool:
    return authorizer.authorize(principal, host, Operation[operation], ResourceType[resource_type], name)


def test_an_allow_grants_its_operation_and_the_describe_it_implies_nothing_else():
    authorizer = Authorizer([acl(operation="read"), acl(resource_type="group", name="billing", operation="read")])
    assert may(authorizer, "read") and may(authorizer, "describe") and may(authorizer, "read", "billing", "group")
    for operation in ("write", "delete", "create", "alter", "alter_configs", "describe_configs"):
        assert not may(authorizer, operation)
    assert not may(authorizer, "read", "payments") and not may(authorizer, "read", "billing2", "group")
    assert not may(authorizer, "read", principal=BOB)


def test_a_deny_overrides_any_allow_and_deny_all_refuses_everything():
    authorizer = Authorizer([acl(operation="all"), acl(name="orders", operation="write", permission="deny")])
    assert may(authorizer, "read") and not may(authorizer, "write")
    authorizer.add([acl(operation="all", permission="deny", principal="User:*")])
    assert not may(authorizer, "read") and not may(authorizer, "describe")


def test_prefixed_and_wildcard_bindings_and_hosts():
    authorizer = Authorizer([
        acl(name="logs-", pattern="prefixed", operation="write"),
        acl(name="*", operation="describe", principal="User:*"),
        acl(name="secret", operation="read", host="10.0.0.8"),
    ])
    assert may(authorizer, "write", "logs-app") and not may(authorizer, "write", "log")
    assert may(authorizer, "describe", "anything", principal=BOB) and not may(authorizer, "read", "anything", principal=BOB)
    assert not may(authorizer, "read", "secret") and may(authorizer, "read", "secret", host="10.0.0.8")


def test_super_users_and_allow_if_no_acls():
    authorizer = Authorizer([acl(operation="read")], super_users=["User:admin"])
    assert may(authorizer, "delete", "anything", principal="User:admin")
    assert not may(authorizer, "read", "unguarded")  # no ACL at all names it: refused, by default
    assert may(Authorizer([acl(operation="read")], allow_if_no_acls=True), "read", "unguarded")
    assert not may(Authorizer([acl(operation="read")], allow_if_no_acls=True), "read", "orders", principal=BOB)


def test_describe_configs_is_implied_by_alter_configs_only():
    authorizer = Authorizer([acl(operation="alter_configs")])
    assert may(authorizer, "describe_configs") and not may(authorizer, "describe")


def test_filters_describe_and_delete_as_kafka_matches_them():
    bindings = [acl(operation="read"), acl(name="logs-", pattern="prefixed"), acl(name="*", principal=BOB),
                acl(resource_type="group", name="billing")]
    authorizer = Authorizer(bindings)
    assert authorizer.describe(AclFilter()) == bindings
    assert authorizer.describe(AclFilter.of({"resource_type": "topic", "name": "logs-app", "pattern": "match"})) == [bindings[1], bindings[2]]
    assert authorizer.describe(AclFilter.of({"principal": BOB})) == [bindings[2]]
    assert authorizer.describe(AclFilter.of({"pattern": "prefixed"})) == [bindings[1]]
    assert authorizer.delete(AclFilter.of({"resource_type": "group"})) == [bindings[3]]
    assert authorizer.bindings == bindings[:3]
    assert authorizer.add([bindings[0]]) == 0  # already there: kept once


@pytest.mark.parametrize("fields, match", [
    ({"principal": "alice"}, "principal"), ({"principal": "Group:x"}, "principal type"), ({"resource_type": "any"}, "filters"),
    ({"operation": "fly"}, "operation"), ({"pattern": "match"}, "filters"), ({"name": ""}, "name"),
    ({"resource_type": "cluster", "name": "c"}, "kafka-cluster"), ({"name": "*", "pattern": "prefixed"}, "prefixed"), ({"colour": 1}, "unknown"),
])
def test_bad_bindings_are_refused(fields, match):
    with pytest.raises(InvalidConfigError, match=match):
        acl(**fields)


OPERATIONS = [o for o in Operation if o not in (Operation.any, Operation.all)]
binding = st.tuples(st.sampled_from([ALICE, BOB, "User:*"]), st.sampled_from(["orders", "ord", "o", "*"]), st.sampled_from(["literal", "prefixed"]),
                    st.sampled_from(OPERATIONS + [Operation.all]), st.sampled_from(["allow", "deny"])).filter(
    lambda t: not (t[1] == "*" and t[2] == "prefixed")).map(
    lambda t: acl(principal=t[0], name=t[1], pattern=t[2], operation=t[3].name, permission=t[4]))


@settings(max_examples=200, deadline=None)
@given(st.lists(binding, max_size=8), st.sampled_from(OPERATIONS))
def test_adding_a_matching_deny_always_refuses_and_removing_every_deny_never_refuses_more(bindings, operation):
    authorizer = Authorizer(bindings)
    allowed = may(authorizer, operation.name)
    authorizer.add([acl(operation=operation.name, permission="deny")])
    assert not may(authorizer, operation.name)
    authorizer.delete(AclFilter.of({"permission": "deny"}))
    assert may(authorizer, operation.name) or not allowed


def decided_by_scanning(authorizer: Authorizer, principal: str, operation: Operation, name: str) -> bool:
    """The decision as the module docstring states it, over every binding (the indexes must agree)."""
    applicable = [b for b in authorizer.bindings if b.applies_to(ResourceType.topic, name)]
    if not applicable:
        return authorizer.allow_if_no_acls
    mine = [b for b in applicable if b.principal in (principal, "User:*")]
    if any(b.permission.name == "deny" and b.operation in (operation, Operation.all) for b in mine):
        return False
    granting = {operation} | ({Operation.read, Operation.write, Operation.delete, Operation.alter} if operation == Operation.describe else set()) \
        | ({Operation.alter_configs} if operation == Operation.describe_configs else set())
    return any(b.permission.name == "allow" and (b.operation == Operation.all or b.operation in granting) for b in mine)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.booleans(), binding), max_size=16), st.sampled_from(OPERATIONS),
       st.sampled_from([ALICE, BOB]), st.sampled_from(["orders", "ord", "o", "*", "order", "other", "x"]), st.booleans())
def test_the_indexed_decision_is_the_decision_over_every_binding(steps, operation, principal, name, allow_if_no_acls):
    authorizer = Authorizer(allow_if_no_acls=allow_if_no_acls)
    for adding, one in steps:  # adds and deletes in any order keep the indexes in step with the bindings
        if adding:
            authorizer.add([one])
        else:
            authorizer.delete(AclFilter.of({"principal": one.principal, "resource_type": "topic", "name": one.name,
                                            "pattern": one.pattern.name, "operation": one.operation.name, "permission": one.permission.name}))
        assert authorizer.authorize(principal, "127.0.0.1", operation, ResourceType.topic, name) \
            == decided_by_scanning(authorizer, principal, operation, name)
