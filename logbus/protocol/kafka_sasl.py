"""SASL authentication on the Kafka gateway's connections: SaslHandshake and SaslAuthenticate, sans-IO.

With SASL on, a connection starts unauthenticated and may send only
ApiVersions (any number), one SaslHandshake v1 naming a mechanism, and the
SaslAuthenticate rounds of that mechanism; anything else, or anything after
a failed authentication, ends the connection (:class:`KafkaProtocolError`),
as Kafka's broker ends it. Once authenticated, frames go to the gateway's
:class:`~logbus.protocol.kafka_gateway.KafkaHandler` unchanged, and the
connection knows its principal (``User:NAME``).

Mechanisms (Kafka's names):

- SCRAM-SHA-256/512: :mod:`logbus.protocol.scram`, two rounds; credentials
  are looked up by the gateway (``lookup(user, mechanism)``).
- PLAIN (``authzid NUL user NUL password``, RFC 4616): the password is
  checked against the user's stored SCRAM credential (its salt and
  iterations), so one store serves every mechanism and no password is kept.

SaslHandshake is served in version 1 only: version 0 carries the tokens
outside Kafka's framing, which no current client needs. Sessions do not
expire (``session_lifetime`` 0: clients never re-authenticate, KIP-368).

Limits. Before authentication a frame may be at most
``UNAUTHENTICATED_FRAME_BYTES_MAX`` (Kafka's ``sasl.server.max.receive.size``).
A failed authentication is answered SASL_AUTHENTICATION_FAILED after a delay
that doubles with each recent failure from the same address
(:class:`FailureThrottle`; Kafka's ``connection.failed.authentication.delay.ms``
is the first step), and the connection accepts nothing more. Failures are
counted. Neither passwords nor proofs are ever logged or put in a message:
failures say only the mechanism (and log the user name, which is not secret).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Hashable

from kio.schema.errors import ErrorCode

from logbus.errors import KafkaProtocolError, SaslAuthenticationError
from logbus.protocol.kafka_messages import encode_response, peek_header, read_request
from logbus.protocol.listener_security import PLAIN, ListenerSecurity
from logbus.protocol.scram import MECHANISMS as SCRAM_MECHANISMS
from logbus.protocol.scram import ScramCredential, ScramServer, credential_from_salted, salted_password

logger = logging.getLogger(__name__)

API_VERSIONS, SASL_HANDSHAKE, SASL_AUTHENTICATE = 18, 17, 36
SASL_API_VERSIONS = {SASL_HANDSHAKE: (1, 1), SASL_AUTHENTICATE: (0, 2)}
UNAUTHENTICATED_FRAME_BYTES_MAX = 512 * 1024  # Kafka's sasl.server.max.receive.size
FAILED_DELAY_S_BASE = 0.1  # Kafka's connection.failed.authentication.delay.ms
FAILED_DELAY_S_MAX = 5.0
FAILURE_WINDOW_S = 60.0  # failures older than this no longer lengthen the delay
ADDRESSES_TRACKED_MAX = 10_000  # the throttle forgets the least recently failed address beyond this
PLAIN_BYTES_MAX = 1024

# user, mechanism -> the stored credential, or None for an unknown user
CredentialLookup = Callable[[str, str], Awaitable["ScramCredential | None"]]


class FailureThrottle:
    """Recent authentication failures per client address, and the delay before answering the next one.

    Bounded: at most ``ADDRESSES_TRACKED_MAX`` addresses, the least
    recently failed forgotten first. Reads the clock it is given; nothing
    runs on a timer (old failures are dropped when the address fails again).
    Not thread-safe: one per gateway, on its listener's loop.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._failures: collections.OrderedDict[Hashable, list[float]] = collections.OrderedDict()

    def failed(self, address: Hashable) -> float:
        """Record a failure from ``address``; the seconds to wait before answering it."""
        now = self._clock()
        recent = [t for t in self._failures.pop(address, ()) if now - t < FAILURE_WINDOW_S]
        recent.append(now)
        recent = recent[-32:]  # enough to reach the maximum delay
        self._failures[address] = recent
        while len(self._failures) > ADDRESSES_TRACKED_MAX:
            self._failures.popitem(last=False)
        return min(FAILED_DELAY_S_BASE * 2 ** (len(recent) - 1), FAILED_DELAY_S_MAX)

    def __len__(self) -> int:
        return len(self._failures)


@dataclass
class AuthStats:
    succeeded: int = 0
    failed: int = 0
    refused_frames: int = 0  # connections ended for a request out of turn
    by_mechanism: dict = field(default_factory=dict)


class Authenticator:
    """The gateway's SASL settings, credential lookup, failure throttle and counters (one per gateway)."""

    def __init__(self, security: ListenerSecurity, lookup: CredentialLookup, *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable] = asyncio.sleep) -> None:
        self.security = security
        self.mechanisms = security.sasl_mechanisms
        self._lookup = lookup
        self._sleep = sleep
        self.throttle = FailureThrottle(clock)
        self.stats = AuthStats()
        self._unknown_user_secret = os.urandom(32)

    @property
    def enabled(self) -> bool:
        return bool(self.mechanisms)

    def session(self, address: Hashable) -> "Session":
        return Session(self, address)

    async def credential(self, user: str, mechanism: str) -> ScramCredential | None:
        return await self._lookup(user, mechanism)


class Session:
    """One connection's authentication (see the module docstring); ``start`` is what the connection calls per frame."""

    def __init__(self, authenticator: Authenticator, address: Hashable) -> None:
        self._auth = authenticator
        self.address = address
        self.principal: str | None = None if authenticator.enabled else "User:ANONYMOUS"
        self._mechanism: str | None = None
        self._scram: ScramServer | None = None
        self._failed = False
        self._user: str | None = None  # as the client named it (logged on failure; not secret)

    @property
    def authenticated(self) -> bool:
        return self.principal is not None

    @property
    def frame_bytes_max(self) -> int | None:
        """The largest frame to read now: bounded before authentication, the gateway's own bound after (None)."""
        return None if self.authenticated else UNAUTHENTICATED_FRAME_BYTES_MAX

    def start(self, frame: bytes, start_request: Callable[[bytes], Awaitable[bytes | None]]) -> Awaitable[bytes | None]:
        """The reply to ``frame``: SASL's own here, anything else through ``start_request`` once authenticated."""
        if self.authenticated:
            if self._auth.enabled and peek_header(frame)[0] in (SASL_HANDSHAKE, SASL_AUTHENTICATE):
                self._refuse("a SASL request after authentication (re-authentication is not offered)")
            return start_request(frame)
        api_key, api_version, correlation_id = peek_header(frame)
        if self._failed:
            self._refuse("a request after a failed authentication")
        if api_key == API_VERSIONS:
            return start_request(frame)
        if api_key == SASL_HANDSHAKE and self._mechanism is None and api_version == 1:
            return _done(self._handshake(read_request(frame)))
        if api_key == SASL_AUTHENTICATE and self._mechanism is not None and 0 <= api_version <= 2:
            return self._authenticate(read_request(frame))
        what = {SASL_HANDSHAKE: "SaslHandshake", SASL_AUTHENTICATE: "SaslAuthenticate"}.get(api_key, f"API key {api_key}")
        self._refuse(f"{what} v{api_version} out of turn before authentication")

    def _refuse(self, why: str):
        self._auth.stats.refused_frames += 1
        raise KafkaProtocolError(why)

    def _handshake(self, request) -> bytes:
        mechanism = request.body.mechanism
        offered = list(self._auth.mechanisms)
        if mechanism not in offered:
            self._failed = True
            code = ErrorCode.unsupported_sasl_mechanism
        else:
            self._mechanism = mechanism
            code = ErrorCode.none
        return encode_response(SASL_HANDSHAKE, request.api_version, request.correlation_id, {"error_code": code, "mechanisms": offered})

    async def _authenticate(self, request) -> bytes:
        token = request.body.auth_bytes
        try:
            if self._mechanism == PLAIN:
                reply = await self._plain(token)
            else:
                reply = await self._scram_round(token)
        except SaslAuthenticationError as error:
            return await self._fail(request, error)
        return self._reply(request, ErrorCode.none, None, reply)

    async def _plain(self, token: bytes) -> bytes:
        if len(token) > PLAIN_BYTES_MAX:
            raise SaslAuthenticationError("a PLAIN message over the size limit")
        parts = token.split(b"\0")
        if len(parts) != 3:
            raise SaslAuthenticationError("a PLAIN message that cannot be read")
        try:
            authzid, user, password = (p.decode("utf-8") for p in parts)
        except UnicodeDecodeError:
            raise SaslAuthenticationError("a PLAIN message that is not UTF-8") from None
        if not user or not password or authzid not in ("", user):
            raise SaslAuthenticationError("invalid credentials")
        self._user = user
        for mechanism in ("SCRAM-SHA-512", "SCRAM-SHA-256"):
            credential = await self._auth.credential(user, mechanism)
            if credential is not None:
                # PBKDF2 takes milliseconds: off the listener's loop.
                salted = await asyncio.to_thread(salted_password, mechanism, password, credential.salt, credential.iterations)
                derived = credential_from_salted(mechanism, salted, credential.salt, credential.iterations)
                if hmac.compare_digest(derived.stored_key, credential.stored_key):
                    self._succeed(user)
                    return b""
                break
        else:
            # No credential: spend the same work as a check, so timing does not tell who exists.
            await asyncio.to_thread(hashlib.pbkdf2_hmac, "sha512", password.encode("utf-8"), b"\0" * 32, 4096)
        raise SaslAuthenticationError("invalid credentials")

    async def _scram_round(self, token: bytes) -> bytes:
        if self._scram is None:
            self._scram = ScramServer(self._mechanism, unknown_user_secret=self._auth._unknown_user_secret)
            user = self._scram.first(token)
            self._user = user
            return self._scram.server_first(await self._auth.credential(user, self._mechanism))
        server_final = self._scram.final(token)
        self._succeed(self._scram.user)
        return server_final

    def _succeed(self, user: str) -> None:
        self.principal = f"User:{user}"
        stats = self._auth.stats
        stats.succeeded += 1
        stats.by_mechanism[self._mechanism] = stats.by_mechanism.get(self._mechanism, 0) + 1

    async def _fail(self, request, error: SaslAuthenticationError) -> bytes:
        self._failed = True
        self._auth.stats.failed += 1
        delay_s = self._auth.throttle.failed(self.address[0] if isinstance(self.address, tuple) else self.address)
        logger.info("Kafka gateway: SASL %s authentication failed for user %r from %s: %s", self._mechanism,
                    self._user, self.address, error)
        await self._auth._sleep(delay_s)
        message = f"Authentication failed during authentication due to invalid credentials with SASL mechanism {self._mechanism}"
        return self._reply(request, ErrorCode.sasl_authentication_failed, message, b"")

    @staticmethod
    def _reply(request, code: ErrorCode, message: str | None, token: bytes) -> bytes:
        return encode_response(SASL_AUTHENTICATE, request.api_version, request.correlation_id,
                               {"error_code": code, "error_message": message, "auth_bytes": token, "session_lifetime": 0})


async def _done(value):
    return value


__all__ = ["Authenticator", "FailureThrottle", "Session", "SASL_API_VERSIONS", "SCRAM_MECHANISMS"]
