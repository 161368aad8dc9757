"""The Kafka gateway listener's security settings: TLS, SASL mechanisms, and the rule for leaving loopback.

A gateway on loopback serves only its own machine. Anywhere else, anyone who
reaches the port could read, write and delete every topic, so a gateway that
binds another address refuses to start unless its listener has TLS and a
way to authenticate clients (SASL, or client certificates checked against a
CA), or the caller says ``allow_plaintext`` (which logs a warning each time
a gateway starts so).

TLS is Python's ``ssl`` module: a server context with TLS 1.2 at least;
a CA file turns on client certificate verification (``CERT_REQUIRED``), as
Kafka's ``ssl.client.auth=required``. SASL's mechanisms are Kafka's names;
PLAIN sends the password itself, so it is offered only over TLS unless
``allow_plain_without_tls`` says otherwise.

No sockets here and no Ray: :class:`ListenerSecurity` is a frozen value the
driver validates before starting anything and the gateway actor receives as
a dict.
"""

from __future__ import annotations

import ipaddress
import ssl
from dataclasses import asdict, dataclass

from logbus.errors import InvalidConfigError

SCRAM_SHA_256, SCRAM_SHA_512, PLAIN = "SCRAM-SHA-256", "SCRAM-SHA-512", "PLAIN"
SASL_MECHANISMS = (SCRAM_SHA_512, SCRAM_SHA_256, PLAIN)  # what the gateway can serve, Kafka's names
LOOPBACK_NAMES = ("localhost",)


def is_loopback(host: str) -> bool:
    """Whether listening on ``host`` serves only this machine (127.0.0.0/8, ::1, localhost)."""
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name or a wildcard ("", "0.0.0.0" parses; "" does not): not loopback


@dataclass(frozen=True)
class ListenerSecurity:
    """How a gateway's listener protects itself (see the module docstring).

    ``ssl_certfile``/``ssl_keyfile``: the server's certificate chain and key
    (PEM), both or neither; ``ssl_cafile``: CA certificates that client
    certificates must chain to (requires TLS); ``sasl_mechanisms``: the SASL
    mechanisms offered, empty for none; ``allow_plaintext``: start on a
    non-loopback address without TLS and authentication; ``allow_plain_without_tls``:
    offer PLAIN on a listener without TLS.
    """

    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_cafile: str | None = None
    sasl_mechanisms: tuple[str, ...] = ()
    allow_plaintext: bool = False
    allow_plain_without_tls: bool = False

    def __post_init__(self) -> None:
        for name in ("ssl_certfile", "ssl_keyfile", "ssl_cafile"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidConfigError(f"{name} must be a path (str), not {value!r}")
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise InvalidConfigError("ssl_certfile and ssl_keyfile go together: give both for TLS, or neither")
        if self.ssl_cafile is not None and self.ssl_certfile is None:
            raise InvalidConfigError("ssl_cafile (client certificate verification) needs TLS: give ssl_certfile and ssl_keyfile too")
        mechanisms = self.sasl_mechanisms
        if isinstance(mechanisms, str) or not isinstance(mechanisms, (tuple, list)):
            raise InvalidConfigError(f"sasl_mechanisms must be a sequence of {SASL_MECHANISMS}, not {mechanisms!r}")
        unknown = [m for m in mechanisms if m not in SASL_MECHANISMS]
        if unknown:
            raise InvalidConfigError(f"unknown SASL mechanism(s) {unknown}; the gateway serves {list(SASL_MECHANISMS)}")
        if len(set(mechanisms)) != len(mechanisms):
            raise InvalidConfigError(f"sasl_mechanisms names one twice: {list(mechanisms)}")
        object.__setattr__(self, "sasl_mechanisms", tuple(mechanisms))
        for name in ("allow_plaintext", "allow_plain_without_tls"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidConfigError(f"{name} must be a bool, not {getattr(self, name)!r}")
        if PLAIN in mechanisms and not self.tls and not self.allow_plain_without_tls:
            raise InvalidConfigError("SASL PLAIN sends passwords as they are: it needs TLS (ssl_certfile, ssl_keyfile), "
                                     "or allow_plain_without_tls=True")

    @property
    def tls(self) -> bool:
        return self.ssl_certfile is not None

    @property
    def sasl(self) -> bool:
        return bool(self.sasl_mechanisms)

    @property
    def authenticates(self) -> bool:
        """Whether a client must prove who it is: SASL, or a certificate from the CA."""
        return self.sasl or self.ssl_cafile is not None

    @property
    def security_protocol(self) -> str:
        """Kafka's name for what a client configures: PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL."""
        return ("SASL_" if self.sasl else "") + ("SSL" if self.tls else "PLAINTEXT")

    def exposure_warning(self, host: str) -> str | None:
        """None if ``host`` may be served as configured; else what is wrong with it.

        Raises InvalidConfigError when the listener would serve another
        address without TLS and authentication and ``allow_plaintext`` is not
        set; returns the warning to log when it is set.
        """
        if is_loopback(host) or (self.tls and self.authenticates):
            return None
        missing = " and ".join(w for w, ok in (("TLS", self.tls), ("authentication (SASL or client certificates)", self.authenticates)) if not ok)
        message = (f"the Kafka gateway would listen on {host or 'every address'} without {missing}: anyone who reaches "
                   f"the port could read, write and delete every topic")
        if not self.allow_plaintext:
            raise InvalidConfigError(f"{message}. Give ssl_certfile/ssl_keyfile and sasl_mechanisms (CLI: --tls-cert, "
                                     f"--tls-key, --sasl-mechanism), or allow_plaintext=True (--allow-plaintext) to serve it anyway")
        return message + " (allow_plaintext is set)"

    def ssl_context(self) -> ssl.SSLContext | None:
        """The listener's server context (None without TLS); reads the files now, so a bad one fails the start."""
        if not self.tls:
            return None
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(self.ssl_certfile, self.ssl_keyfile)
            if self.ssl_cafile is not None:
                context.load_verify_locations(cafile=self.ssl_cafile)
                context.verify_mode = ssl.CERT_REQUIRED
        except (OSError, ssl.SSLError) as error:
            raise InvalidConfigError(f"the gateway's TLS files cannot be used ({self.ssl_certfile}, {self.ssl_keyfile}, "
                                     f"{self.ssl_cafile}): {error}") from None
        return context

    def to_dict(self) -> dict:
        out = asdict(self)
        out["sasl_mechanisms"] = list(self.sasl_mechanisms)
        return out

    @classmethod
    def from_dict(cls, raw: dict | None) -> "ListenerSecurity":
        if not raw:
            return cls()
        return cls(**{**raw, "sasl_mechanisms": tuple(raw.get("sasl_mechanisms", ()))})
