"""ACLs as Kafka's authorizer (``StandardAuthorizer``) has them: bindings, filters, and the decision. Sans-IO.

A binding says: ``principal`` (``User:alice``, or ``User:*`` for everyone)
from ``host`` (an address, or ``*``) may (``allow``) or may not (``deny``)
perform ``operation`` on resources of ``resource_type`` named ``name`` —
exactly that name (``literal``; the literal name ``*`` is every resource of
the type) or every name starting with it (``prefixed``).

The decision, for one principal, host, operation and resource, in Kafka's
order:

1. A super user may do anything.
2. A deny binding that matches (its operation the one asked, or ``all``)
   refuses, whatever allows it.
3. An allow binding that matches grants. Asking to ``describe`` is granted
   by an allow of read, write, delete or alter too, and ``describe_configs``
   by ``alter_configs``, as Kafka implies them.
4. Otherwise: refused, unless no binding at all names the resource and the
   authorizer was made with ``allow_if_no_acls`` (Kafka's
   ``allow.everyone.if.no.acl.found``; off by default).

Codes are Kafka's (the numbers its CreateAcls/DescribeAcls/DeleteAcls
messages carry); names are Kafka's in lower case. Filters (DescribeAcls,
DeleteAcls) use ``any`` for every field, and pattern ``match``: the
bindings that would apply to the named resource (literal, ``*``, prefixes).

Not thread-safe; the owner serialises access.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterable, Mapping

from logbus.errors import InvalidConfigError


class ResourceType(enum.IntEnum):
    any = 1
    topic = 2
    group = 3
    cluster = 4
    transactional_id = 5


class PatternType(enum.IntEnum):
    any = 1
    match = 2
    literal = 3
    prefixed = 4


class Operation(enum.IntEnum):
    any = 1
    all = 2
    read = 3
    write = 4
    create = 5
    delete = 6
    alter = 7
    describe = 8
    cluster_action = 9
    describe_configs = 10
    alter_configs = 11
    idempotent_write = 12


class Permission(enum.IntEnum):
    any = 1
    deny = 2
    allow = 3


WILDCARD = "*"
CLUSTER_NAME = "kafka-cluster"  # the one cluster resource's name, as Kafka names it
PRINCIPAL_TYPE = "User"
# An allow of any of these grants describe too; of alter_configs, describe_configs (Kafka's implied operations).
IMPLIES = {
    Operation.describe: (Operation.describe, Operation.read, Operation.write, Operation.delete, Operation.alter),
    Operation.describe_configs: (Operation.describe_configs, Operation.alter_configs),
}
BINDINGS_MAX = 100_000  # a bound on what one cluster keeps (a check reads only the bindings that could apply)


def _enum(cls, value, what: str, *, filtering: bool):
    try:
        member = cls[value.lower()] if isinstance(value, str) else cls(value)
    except (KeyError, ValueError):
        raise InvalidConfigError(f"{what} must be one of {[m.name for m in cls]}, not {value!r}") from None
    if not filtering and member.name in ("any", "match"):
        raise InvalidConfigError(f"{what} {member.name!r} is for filters, not bindings")
    return member


def _principal(value, *, filtering: bool) -> str | None:
    if value is None and filtering:
        return None
    if not isinstance(value, str) or ":" not in value or not value.split(":", 1)[1]:
        raise InvalidConfigError(f"principal must be 'User:NAME' (or 'User:*'), not {value!r}")
    kind = value.split(":", 1)[0]
    if kind != PRINCIPAL_TYPE:
        raise InvalidConfigError(f"principal type must be {PRINCIPAL_TYPE!r}, not {kind!r}")
    return value


@dataclass(frozen=True)
class AclBinding:
    """One ACL (see the module docstring). Build it from Kafka's fields in lower case with :meth:`of`."""

    principal: str
    resource_type: ResourceType
    name: str
    pattern: PatternType = PatternType.literal
    operation: Operation = Operation.all
    permission: Permission = Permission.allow
    host: str = WILDCARD

    def __post_init__(self) -> None:
        object.__setattr__(self, "resource_type", _enum(ResourceType, self.resource_type, "resource_type", filtering=False))
        object.__setattr__(self, "pattern", _enum(PatternType, self.pattern, "pattern", filtering=False))
        object.__setattr__(self, "operation", _enum(Operation, self.operation, "operation", filtering=False))
        object.__setattr__(self, "permission", _enum(Permission, self.permission, "permission", filtering=False))
        _principal(self.principal, filtering=False)
        if not isinstance(self.name, str) or not self.name:
            raise InvalidConfigError(f"an ACL's resource name must be a non-empty str, not {self.name!r}")
        if self.resource_type == ResourceType.cluster and self.name != CLUSTER_NAME:
            raise InvalidConfigError(f"the cluster resource is named {CLUSTER_NAME!r}, not {self.name!r}")
        if self.pattern == PatternType.prefixed and self.name == WILDCARD:
            raise InvalidConfigError("a prefixed ACL on '*' means nothing: use a literal '*'")
        if not isinstance(self.host, str) or not self.host:
            raise InvalidConfigError(f"an ACL's host must be an address or '*', not {self.host!r}")

    @classmethod
    def of(cls, value: "AclBinding | Mapping") -> "AclBinding":
        """A binding from itself or from a dict of Kafka's fields in lower case (``principal``, ``resource_type``,
        ``name``, ``pattern``, ``operation``, ``permission``, ``host``)."""
        if isinstance(value, AclBinding):
            return value
        if not isinstance(value, Mapping):
            raise InvalidConfigError(f"an ACL binding must be an AclBinding or a dict, not {value!r}")
        unknown = set(value) - set(cls.__dataclass_fields__)
        if unknown:
            raise InvalidConfigError(f"unknown ACL field(s) {sorted(unknown)}")
        return cls(**value)

    def to_dict(self) -> dict:
        return {"principal": self.principal, "resource_type": self.resource_type.name, "name": self.name, "pattern": self.pattern.name,
                "operation": self.operation.name, "permission": self.permission.name, "host": self.host}

    def applies_to(self, resource_type: ResourceType, name: str) -> bool:
        """Whether this binding's resource pattern covers the resource ``name`` of ``resource_type``."""
        if self.resource_type != resource_type:
            return False
        if self.pattern == PatternType.literal:
            return self.name == name or self.name == WILDCARD
        return name.startswith(self.name)


@dataclass(frozen=True)
class AclFilter:
    """Which bindings DescribeAcls and DeleteAcls mean: each field None or ``any`` matches every binding."""

    principal: str | None = None
    resource_type: ResourceType = ResourceType.any
    name: str | None = None
    pattern: PatternType = PatternType.any
    operation: Operation = Operation.any
    permission: Permission = Permission.any
    host: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "resource_type", _enum(ResourceType, self.resource_type, "resource_type", filtering=True))
        object.__setattr__(self, "pattern", _enum(PatternType, self.pattern, "pattern", filtering=True))
        object.__setattr__(self, "operation", _enum(Operation, self.operation, "operation", filtering=True))
        object.__setattr__(self, "permission", _enum(Permission, self.permission, "permission", filtering=True))
        _principal(self.principal, filtering=True)
        if self.pattern == PatternType.match and self.name is None:
            raise InvalidConfigError("a 'match' filter needs a resource name")

    @classmethod
    def of(cls, value: "AclFilter | Mapping | None") -> "AclFilter":
        if value is None:
            return cls()
        if isinstance(value, AclFilter):
            return value
        if not isinstance(value, Mapping):
            raise InvalidConfigError(f"an ACL filter must be an AclFilter or a dict, not {value!r}")
        unknown = set(value) - set(cls.__dataclass_fields__)
        if unknown:
            raise InvalidConfigError(f"unknown ACL filter field(s) {sorted(unknown)}")
        return cls(**value)

    def to_dict(self) -> dict:
        return {"principal": self.principal, "resource_type": self.resource_type.name, "name": self.name, "pattern": self.pattern.name,
                "operation": self.operation.name, "permission": self.permission.name, "host": self.host}

    def matches(self, binding: AclBinding) -> bool:
        if self.principal is not None and binding.principal != self.principal:
            return False
        if self.host is not None and binding.host != self.host:
            return False
        if self.operation != Operation.any and binding.operation != self.operation:
            return False
        if self.permission != Permission.any and binding.permission != self.permission:
            return False
        if self.resource_type != ResourceType.any and binding.resource_type != self.resource_type:
            return False
        if self.pattern == PatternType.match:
            return binding.applies_to(binding.resource_type, self.name) if self.resource_type == ResourceType.any \
                else binding.applies_to(self.resource_type, self.name)
        if self.pattern != PatternType.any and binding.pattern != self.pattern:
            return False
        return self.name is None or binding.name == self.name


class Authorizer:
    """The bindings of a cluster and the decision (see the module docstring)."""

    def __init__(self, bindings: Iterable[AclBinding] = (), *, super_users: Iterable[str] = (), allow_if_no_acls: bool = False) -> None:
        self.super_users = frozenset(_principal(p, filtering=False) for p in super_users)
        self.allow_if_no_acls = allow_if_no_acls
        self._bindings: dict[AclBinding, None] = {}  # ordered, unique
        # Indexes, so a check costs the bindings that could apply rather than every binding: literal
        # bindings by (type, name) (the name ``*`` among them), prefixed ones by (type, prefix), with
        # the prefix lengths in use per type (a check looks up only those), and every binding by type.
        self._literal: dict[tuple[ResourceType, str], list[AclBinding]] = {}
        self._prefixed: dict[tuple[ResourceType, str], list[AclBinding]] = {}
        self._prefix_lengths: dict[ResourceType, dict[int, int]] = {}
        self._by_type: dict[ResourceType, list[AclBinding]] = {}
        self.add(bindings)

    @property
    def bindings(self) -> list[AclBinding]:
        return list(self._bindings)

    def add(self, bindings: Iterable[AclBinding]) -> int:
        """Add bindings (one already there stays once); how many were new."""
        added = 0
        for binding in bindings:
            if binding not in self._bindings:
                if len(self._bindings) >= BINDINGS_MAX:
                    raise InvalidConfigError(f"at most {BINDINGS_MAX} ACL bindings")
                self._bindings[binding] = None
                self._index(binding)
                added += 1
        return added

    def _index(self, binding: AclBinding) -> None:
        key = (binding.resource_type, binding.name)
        if binding.pattern == PatternType.prefixed:
            self._prefixed.setdefault(key, []).append(binding)
            lengths = self._prefix_lengths.setdefault(binding.resource_type, {})
            lengths[len(binding.name)] = lengths.get(len(binding.name), 0) + 1
        else:
            self._literal.setdefault(key, []).append(binding)
        self._by_type.setdefault(binding.resource_type, []).append(binding)

    def _unindex(self, binding: AclBinding) -> None:
        key = (binding.resource_type, binding.name)
        if binding.pattern == PatternType.prefixed:
            _remove(self._prefixed, key, binding)
            lengths = self._prefix_lengths[binding.resource_type]
            lengths[len(binding.name)] -= 1
            if not lengths[len(binding.name)]:
                del lengths[len(binding.name)]
        else:
            _remove(self._literal, key, binding)
        _remove(self._by_type, binding.resource_type, binding)

    def _applicable(self, resource_type: ResourceType, name: str) -> list[AclBinding]:
        """The bindings whose pattern covers the resource (what ``applies_to`` would pick out of all)."""
        found = list(self._literal.get((resource_type, name), ()))
        if name != WILDCARD:
            found += self._literal.get((resource_type, WILDCARD), ())
        for length in self._prefix_lengths.get(resource_type, ()):
            if length <= len(name):
                found += self._prefixed.get((resource_type, name[:length]), ())
        return found

    def describe(self, acl_filter: AclFilter) -> list[AclBinding]:
        return [b for b in self._bindings if acl_filter.matches(b)]

    def delete(self, acl_filter: AclFilter) -> list[AclBinding]:
        """Delete the bindings the filter matches; them."""
        gone = self.describe(acl_filter)
        for binding in gone:
            del self._bindings[binding]
            self._unindex(binding)
        return gone

    def authorize(self, principal: str, host: str, operation: Operation, resource_type: ResourceType, name: str) -> bool:
        """Whether ``principal`` connected from ``host`` may perform ``operation`` on the resource."""
        if principal in self.super_users:
            return True
        applicable = self._applicable(resource_type, name)
        if not applicable:
            return self.allow_if_no_acls
        mine = [b for b in applicable if b.principal in (principal, f"{PRINCIPAL_TYPE}:{WILDCARD}") and b.host in (host, WILDCARD)]
        if any(b.permission == Permission.deny and b.operation in (operation, Operation.all) for b in mine):
            return False
        granting = IMPLIES.get(operation, (operation,))
        return any(b.permission == Permission.allow and (b.operation == Operation.all or b.operation in granting) for b in mine)

    def authorize_any(self, principal: str, host: str, operation: Operation, resource_type: ResourceType) -> bool:
        """Whether ``principal`` may perform ``operation`` on some resource of ``resource_type`` (Kafka's
        ``authorizeByResourceType``: an idempotent producer's InitProducerId asks for a write on any topic).

        True when an allow binding of the principal grants the operation on
        some name that no deny binding of the principal covers; a deny on the
        literal ``*`` refuses every name.
        """
        if principal in self.super_users:
            return True
        mine = [b for b in self._by_type.get(resource_type, ()) if b.principal in (principal, f"{PRINCIPAL_TYPE}:{WILDCARD}")
                and b.host in (host, WILDCARD)]
        granting = IMPLIES.get(operation, (operation,))
        denies = [b for b in mine if b.permission == Permission.deny and b.operation in (operation, Operation.all)]
        for allow in mine:
            if allow.permission != Permission.allow or not (allow.operation == Operation.all or allow.operation in granting):
                continue
            if not any(d.applies_to(resource_type, allow.name) for d in denies):
                return True
        return False


def _remove(index: dict, key, binding: AclBinding) -> None:
    entries = index[key]
    entries.remove(binding)
    if not entries:
        del index[key]
