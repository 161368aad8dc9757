"""SCRAM (RFC 5802) with SHA-256 and SHA-512 (RFC 7677), as Kafka's SCRAM-SHA-256/512 SASL mechanisms: sans-IO.

Credentials. A user's password is never stored: :func:`make_credential`
derives, from a random salt and ``iterations`` rounds of PBKDF2,

    SaltedPassword = Hi(password, salt, i)        (PBKDF2-HMAC-H)
    StoredKey      = H(HMAC(SaltedPassword, "Client Key"))
    ServerKey      = HMAC(SaltedPassword, "Server Key")

and keeps (salt, StoredKey, ServerKey, i): enough to check a client's proof
and prove the server knows the credential, not enough to log in as the user.
Kafka's limits hold: 4096 to 16384 iterations.

The exchange (client first, then server), with a ``ScramServer`` per
authentication:

    client-first   n,,n=USER,r=CNONCE
    server-first   r=CNONCE SNONCE,s=SALT,i=ITERATIONS
    client-final   c=biws,r=CNONCE SNONCE,p=PROOF
    server-final   v=SERVER_SIGNATURE

The server checks the proof: ClientSignature = HMAC(StoredKey, AuthMessage),
ClientKey = PROOF xor ClientSignature, H(ClientKey) must be StoredKey. An
unknown user gets a made-up salt (derived from the user name and a secret of
the server's, so asking twice gives the same) and fails at the proof, the
same way a wrong password fails: the exchange does not tell who exists.
Channel binding is not offered (gs2 header ``n`` or ``y``; ``p=`` is refused),
as Kafka has it; ``a=`` (an authorization id) must name the user itself.

Every failure raises :class:`SaslAuthenticationError` with a message that names neither
the password nor the proof.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
from dataclasses import dataclass
from typing import Callable

from logbus.errors import InvalidConfigError, SaslAuthenticationError

MECHANISMS = {"SCRAM-SHA-256": "sha256", "SCRAM-SHA-512": "sha512"}
ITERATIONS_MIN, ITERATIONS_MAX = 4096, 16384  # Kafka's bounds (ScramMechanism.minIterations, maxIterations)
ITERATIONS_DEFAULT = 4096
SALT_BYTES = 32
NONCE_BYTES = 24
MESSAGE_BYTES_MAX = 4096  # a SCRAM message longer than this is not a client's (names and nonces are short)
USER_BYTES_MAX = 256


@dataclass(frozen=True)
class ScramCredential:
    """What the server keeps of a user's password for one mechanism (see the module docstring)."""

    salt: bytes
    stored_key: bytes
    server_key: bytes
    iterations: int

    def to_dict(self) -> dict:
        return {"salt": _b64(self.salt), "stored_key": _b64(self.stored_key), "server_key": _b64(self.server_key),
                "iterations": self.iterations}

    @classmethod
    def from_dict(cls, raw: dict) -> "ScramCredential":
        return cls(base64.b64decode(raw["salt"]), base64.b64decode(raw["stored_key"]), base64.b64decode(raw["server_key"]),
                   int(raw["iterations"]))


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _hash_name(mechanism: str) -> str:
    try:
        return MECHANISMS[mechanism]
    except KeyError:
        raise InvalidConfigError(f"SCRAM mechanism must be one of {sorted(MECHANISMS)}, not {mechanism!r}") from None


def salted_password(mechanism: str, password: str, salt: bytes, iterations: int) -> bytes:
    """Hi(password, salt, i): PBKDF2 with the mechanism's HMAC (the password as UTF-8, as Kafka's clients send it)."""
    return hashlib.pbkdf2_hmac(_hash_name(mechanism), password.encode("utf-8"), salt, iterations)


def _hmac(name: str, key: bytes, message: bytes) -> bytes:
    return hmac.new(key, message, name).digest()


def credential_from_salted(mechanism: str, salted: bytes, salt: bytes, iterations: int) -> ScramCredential:
    name = _hash_name(mechanism)
    client_key = _hmac(name, salted, b"Client Key")
    return ScramCredential(salt, hashlib.new(name, client_key).digest(), _hmac(name, salted, b"Server Key"), iterations)


def make_credential(mechanism: str, password: str, *, iterations: int = ITERATIONS_DEFAULT, salt: bytes | None = None) -> ScramCredential:
    """The credential to store for ``password`` (a fresh random salt unless one is given)."""
    if not isinstance(password, str) or not password:
        raise InvalidConfigError("a SCRAM password must be a non-empty str")
    if isinstance(iterations, bool) or not isinstance(iterations, int) or not ITERATIONS_MIN <= iterations <= ITERATIONS_MAX:
        raise InvalidConfigError(f"SCRAM iterations must be an int in {ITERATIONS_MIN}..{ITERATIONS_MAX}, not {iterations!r}")
    salt = os.urandom(SALT_BYTES) if salt is None else salt
    return credential_from_salted(mechanism, salted_password(mechanism, password, salt, iterations), salt, iterations)


def check_user_name(name: object) -> str:
    """A user name SCRAM and Kafka's principals can carry: a non-empty str, printable, at most USER_BYTES_MAX bytes."""
    if not isinstance(name, str) or not name or len(name.encode("utf-8")) > USER_BYTES_MAX or not name.isprintable():
        raise InvalidConfigError(f"a user name must be a non-empty printable str of at most {USER_BYTES_MAX} bytes, not {name!r}")
    return name


def _attributes(message: str) -> list[tuple[str, str]]:
    out = []
    for part in message.split(","):
        if len(part) < 2 or part[1] != "=":
            raise SaslAuthenticationError("a SCRAM message that cannot be read")
        out.append((part[0], part[2:]))
    return out


def _unescape(name: str) -> str:
    """saslname: "=2C" is ",", "=3D" is "=", and no other "="."""
    if "=" in name.replace("=2C", "").replace("=3D", ""):
        raise SaslAuthenticationError("a SCRAM user name that cannot be read")
    return name.replace("=2C", ",").replace("=3D", "=")


def _decode(data: bytes) -> str:
    if len(data) > MESSAGE_BYTES_MAX:
        raise SaslAuthenticationError("a SCRAM message over the size limit")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise SaslAuthenticationError("a SCRAM message that is not UTF-8") from None


# Look a user's credential up: (user, mechanism) -> the credential, or None for an unknown user.
CredentialLookup = Callable[[str, str], "ScramCredential | None"]


class ScramServer:
    """One authentication's server side: feed it the client's two messages in turn.

    ``first(client_first)`` returns (user, server-first message); the caller
    looks the user's credential up (None if unknown) and hands it to
    ``final(client_final, credential)``, which returns the server-final
    message once the proof holds. ``nonce`` and ``unknown_user_secret`` are
    for tests (RFC 7677's vector) and for made-up salts.
    """

    def __init__(self, mechanism: str, *, unknown_user_secret: bytes, nonce: str | None = None) -> None:
        self.mechanism = mechanism
        self._hash = _hash_name(mechanism)
        self._secret = unknown_user_secret
        self._nonce = nonce if nonce is not None else base64.b64encode(os.urandom(NONCE_BYTES)).decode("ascii")
        self.user: str | None = None
        self._gs2_header = ""
        self._client_first_bare = ""
        self._server_first = ""
        self._combined_nonce = ""
        self._credential: ScramCredential | None = None
        self._step = 0

    def first(self, message: bytes) -> str:
        """Read client-first; the user name it names (the caller then calls ``server_first``)."""
        if self._step != 0:
            raise SaslAuthenticationError("a SCRAM client-first message out of turn")
        text = _decode(message)
        parts = text.split(",", 2)
        if len(parts) != 3:
            raise SaslAuthenticationError("a SCRAM client-first message that cannot be read")
        binding, authzid, bare = parts
        if binding not in ("n", "y"):
            raise SaslAuthenticationError("SCRAM channel binding is not supported")
        attributes = _attributes(bare)
        if len(attributes) < 2 or attributes[0][0] != "n" or attributes[1][0] != "r" or not attributes[1][1]:
            raise SaslAuthenticationError("a SCRAM client-first message that cannot be read")
        if any(key == "m" for key, _ in attributes):
            raise SaslAuthenticationError("SCRAM extensions marked mandatory are not supported")
        user = _unescape(attributes[0][1])
        if not user:
            raise SaslAuthenticationError("a SCRAM client-first message without a user name")
        if authzid and (not authzid.startswith("a=") or _unescape(authzid[2:]) != user):
            raise SaslAuthenticationError("a SCRAM authorization id other than the user itself")
        self.user = user
        self._gs2_header = f"{binding},{authzid},"
        self._client_first_bare = bare
        self._combined_nonce = attributes[1][1] + self._nonce
        self._step = 1
        return user

    def server_first(self, credential: ScramCredential | None) -> bytes:
        """server-first, with the user's salt and iterations (made up for an unknown user)."""
        if self._step != 1:
            raise SaslAuthenticationError("a SCRAM server-first message out of turn")
        if credential is None:
            fake_salt = hmac.new(self._secret, self.user.encode("utf-8") + self.mechanism.encode(), "sha256").digest()
            credential = ScramCredential(fake_salt, b"", b"", ITERATIONS_DEFAULT)  # no key matches an empty one
        self._credential = credential
        self._server_first = f"r={self._combined_nonce},s={_b64(credential.salt)},i={credential.iterations}"
        self._step = 2
        return self._server_first.encode("ascii")

    def final(self, message: bytes) -> bytes:
        """Check client-final's proof; server-final if it holds, else SaslAuthenticationError (the same for every wrong proof)."""
        if self._step != 2:
            raise SaslAuthenticationError("a SCRAM client-final message out of turn")
        self._step = 3
        text = _decode(message)
        attributes = _attributes(text)
        if len(attributes) < 3 or attributes[0][0] != "c" or attributes[1][0] != "r" or attributes[-1][0] != "p":
            raise SaslAuthenticationError("a SCRAM client-final message that cannot be read")
        try:
            binding = base64.b64decode(attributes[0][1], validate=True).decode("utf-8")
            proof = base64.b64decode(attributes[-1][1], validate=True)
        except (ValueError, UnicodeDecodeError):
            raise SaslAuthenticationError("a SCRAM client-final message that cannot be read") from None
        if binding != self._gs2_header:
            raise SaslAuthenticationError("SCRAM channel binding does not match the client-first message")
        if attributes[1][1] != self._combined_nonce:
            raise SaslAuthenticationError("a SCRAM nonce that is not this exchange's")
        without_proof = text[: text.rindex(",p=")]
        auth_message = f"{self._client_first_bare},{self._server_first},{without_proof}".encode("utf-8")
        credential = self._credential
        client_signature = _hmac(self._hash, credential.stored_key, auth_message)
        if len(proof) != len(client_signature) or not credential.stored_key:
            raise SaslAuthenticationError("invalid credentials")
        client_key = bytes(a ^ b for a, b in zip(proof, client_signature))
        if not hmac.compare_digest(hashlib.new(self._hash, client_key).digest(), credential.stored_key):
            raise SaslAuthenticationError("invalid credentials")
        return ("v=" + _b64(_hmac(self._hash, credential.server_key, auth_message))).encode("ascii")

    @property
    def done(self) -> bool:
        return self._step == 3


class ScramClient:
    """A client's side of the exchange (for tests and tools): ``first()``, ``final(server_first)``, ``check(server_final)``."""

    def __init__(self, mechanism: str, user: str, password: str, *, nonce: str | None = None) -> None:
        self.mechanism, self._hash = mechanism, _hash_name(mechanism)
        self.user, self._password = user, password
        self._nonce = nonce if nonce is not None else base64.b64encode(os.urandom(NONCE_BYTES)).decode("ascii")
        escaped = user.replace("=", "=3D").replace(",", "=2C")
        self._first_bare = f"n={escaped},r={self._nonce}"
        self._server_signature = b""

    def first(self) -> bytes:
        return ("n,," + self._first_bare).encode("utf-8")

    def final(self, server_first: bytes) -> bytes:
        text = server_first.decode("utf-8")
        attributes = dict(_attributes(text))
        if not attributes["r"].startswith(self._nonce):
            raise SaslAuthenticationError("the server's nonce does not extend the client's")
        salt, iterations = base64.b64decode(attributes["s"]), int(attributes["i"])
        salted = salted_password(self.mechanism, self._password, salt, iterations)
        client_key = _hmac(self._hash, salted, b"Client Key")
        stored_key = hashlib.new(self._hash, client_key).digest()
        without_proof = f"c={_b64(b'n,,')},r={attributes['r']}"
        auth_message = f"{self._first_bare},{text},{without_proof}".encode("utf-8")
        signature = _hmac(self._hash, stored_key, auth_message)
        proof = bytes(a ^ b for a, b in zip(client_key, signature))
        self._server_signature = _hmac(self._hash, _hmac(self._hash, salted, b"Server Key"), auth_message)
        return f"{without_proof},p={_b64(proof)}".encode("utf-8")

    def check(self, server_final: bytes) -> bool:
        return hmac.compare_digest(server_final, b"v=" + _b64(self._server_signature).encode("ascii"))
