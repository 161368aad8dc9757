"""The gateway listener's security settings without Ray: the rule for leaving loopback, and bad settings."""

from __future__ import annotations

import pytest

from logbus.errors import InvalidConfigError
from logbus.protocol.listener_security import ListenerSecurity, is_loopback

TLS = {"ssl_certfile": "cert.pem", "ssl_keyfile": "key.pem"}


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"])
def test_loopback_is_served_as_configured(host):
    assert is_loopback(host) and ListenerSecurity().exposure_warning(host) is None


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "10.1.2.3", "gateway.example.com"])
def test_other_addresses_need_tls_and_authentication_or_allow_plaintext(host):
    for settings in ({}, TLS, {"sasl_mechanisms": ("SCRAM-SHA-512",)}):  # neither, TLS alone, SASL alone
        with pytest.raises(InvalidConfigError, match="allow_plaintext"):
            ListenerSecurity(**settings).exposure_warning(host)
        warning = ListenerSecurity(**settings, allow_plaintext=True).exposure_warning(host)
        assert "anyone who reaches the port" in warning and "allow_plaintext is set" in warning
    assert ListenerSecurity(**TLS, sasl_mechanisms=("SCRAM-SHA-512",)).exposure_warning(host) is None
    assert ListenerSecurity(**TLS, ssl_cafile="ca.pem").exposure_warning(host) is None  # client certificates authenticate


def test_security_protocol_names_are_kafkas():
    assert ListenerSecurity().security_protocol == "PLAINTEXT"
    assert ListenerSecurity(**TLS).security_protocol == "SSL"
    assert ListenerSecurity(**TLS, sasl_mechanisms=("PLAIN",)).security_protocol == "SASL_SSL"
    assert ListenerSecurity(sasl_mechanisms=("SCRAM-SHA-256",)).security_protocol == "SASL_PLAINTEXT"


@pytest.mark.parametrize("settings, match", [
    ({"ssl_certfile": "cert.pem"}, "go together"),
    ({"ssl_cafile": "ca.pem"}, "needs TLS"),
    ({"sasl_mechanisms": ("GSSAPI",)}, "unknown SASL"),
    ({"sasl_mechanisms": "PLAIN"}, "sequence"),
    ({"sasl_mechanisms": ("PLAIN",)}, "needs TLS"),  # passwords in the clear, unless allowed
    ({**TLS, "sasl_mechanisms": ("PLAIN", "PLAIN")}, "twice"),
    ({"allow_plaintext": "yes"}, "bool"),
    ({"ssl_certfile": "", "ssl_keyfile": "k"}, "path"),
])
def test_bad_settings_are_refused(settings, match):
    with pytest.raises(InvalidConfigError, match=match):
        ListenerSecurity(**settings)


def test_plain_without_tls_when_allowed_and_the_settings_round_trip():
    security = ListenerSecurity(sasl_mechanisms=["PLAIN"], allow_plain_without_tls=True)
    assert security.sasl_mechanisms == ("PLAIN",)
    assert ListenerSecurity.from_dict(security.to_dict()) == security
    assert ListenerSecurity.from_dict(None) == ListenerSecurity()


def test_tls_files_that_cannot_be_read_are_refused(tmp_path):
    with pytest.raises(InvalidConfigError, match="cannot be used"):
        ListenerSecurity(str(tmp_path / "no-cert.pem"), str(tmp_path / "no-key.pem")).ssl_context()
    assert ListenerSecurity().ssl_context() is None
