"""SCRAM-SHA-256/512 (RFC 5802, 7677) without Ray: RFC 7677's test vector, round trips, and bad messages."""

from __future__ import annotations

import base64

import pytest
from hypothesis import given, settings, strategies as st

from logbus.errors import InvalidConfigError, SaslAuthenticationError
from logbus.protocol.scram import (
    ITERATIONS_MIN,
    ScramClient,
    ScramServer,
    make_credential,
)

SECRET = b"server secret for unknown users"

# RFC 7677, section 3: user "user", password "pencil", SCRAM-SHA-256.
CLIENT_NONCE = "rOprNGfwEbeRWgbNEkqO"
SERVER_NONCE = "%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0"
SALT = base64.b64decode("W22ZaJ0SNY7soEsUEjb6gQ==")
CLIENT_FIRST = b"n,,n=user,r=rOprNGfwEbeRWgbNEkqO"
SERVER_FIRST = b"r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096"
CLIENT_FINAL = b"c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ="
SERVER_FINAL = b"v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4="


def test_rfc_7677_vector_server_side():
    credential = make_credential("SCRAM-SHA-256", "pencil", salt=SALT, iterations=4096)
    server = ScramServer("SCRAM-SHA-256", unknown_user_secret=SECRET, nonce=SERVER_NONCE)
    assert server.first(CLIENT_FIRST) == "user"
    assert server.server_first(credential) == SERVER_FIRST
    assert server.final(CLIENT_FINAL) == SERVER_FINAL


def test_rfc_7677_vector_client_side():
    client = ScramClient("SCRAM-SHA-256", "user", "pencil", nonce=CLIENT_NONCE)
    assert client.first() == CLIENT_FIRST
    assert client.final(SERVER_FIRST) == CLIENT_FINAL
    assert client.check(SERVER_FINAL) and not client.check(b"v=" + base64.b64encode(b"x" * 32))


def exchange(mechanism: str, user: str, password: str, stored_password: str | None):
    credential = None if stored_password is None else make_credential(mechanism, stored_password, iterations=ITERATIONS_MIN)
    server = ScramServer(mechanism, unknown_user_secret=SECRET)
    client = ScramClient(mechanism, user, password)
    assert server.first(client.first()) == user
    server_final = server.final(client.final(server.server_first(credential)))
    return client.check(server_final)


@settings(max_examples=25, deadline=None)
@given(mechanism=st.sampled_from(["SCRAM-SHA-256", "SCRAM-SHA-512"]),
       user=st.text(st.characters(blacklist_categories=("Cs", "Cc", "Zl", "Zp")), min_size=1, max_size=20).filter(str.isprintable),
       password=st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=30))
def test_the_right_password_authenticates_any_user_name_including_commas_and_equals(mechanism, user, password):
    assert exchange(mechanism, user, password, password)


@settings(max_examples=25, deadline=None)
@given(mechanism=st.sampled_from(["SCRAM-SHA-256", "SCRAM-SHA-512"]), password=st.text(min_size=1, max_size=20),
       other=st.text(min_size=1, max_size=20))
def test_a_wrong_password_and_an_unknown_user_fail_alike(mechanism, password, other):
    if other != password:
        with pytest.raises(SaslAuthenticationError, match="^invalid credentials$"):
            exchange(mechanism, "alice", other, password)
    with pytest.raises(SaslAuthenticationError, match="^invalid credentials$"):
        exchange(mechanism, "nobody", password, None)


def test_an_unknown_users_salt_is_stable_and_looks_like_a_real_one():
    def salt_of(user: str) -> bytes:
        server = ScramServer("SCRAM-SHA-512", unknown_user_secret=SECRET)
        server.first(ScramClient("SCRAM-SHA-512", user, "x").first())
        first = dict(part.split("=", 1) for part in server.server_first(None).decode().split(","))
        return base64.b64decode(first["s"])

    assert salt_of("ghost") == salt_of("ghost") != salt_of("spectre")
    assert len(salt_of("ghost")) == 32


def test_credentials_do_not_contain_the_password_and_salts_differ():
    one, two = make_credential("SCRAM-SHA-512", "hunter2"), make_credential("SCRAM-SHA-512", "hunter2")
    assert one.salt != two.salt and one.stored_key != two.stored_key
    assert "hunter2" not in repr(one.to_dict())
    assert type(one).from_dict(one.to_dict()) == one
    with pytest.raises(InvalidConfigError):
        make_credential("SCRAM-SHA-512", "x", iterations=100)
    with pytest.raises(InvalidConfigError):
        make_credential("SCRAM-SHA-1", "x")


@pytest.mark.parametrize("client_first", [
    b"", b"n,,", b"p=tls-unique,,n=user,r=abc", b"n,,n=user", b"n,,r=abc,n=user", b"n,,n=,r=abc", b"n,,n=us=er,r=abc",
    b"n,a=other,n=user,r=abc", b"n,,n=user,r=abc,m=ext", b"\xff\xfe", b"n,,n=user,r=" + b"a" * 5000,
])
def test_client_first_messages_that_cannot_be_served_are_refused(client_first):
    with pytest.raises(SaslAuthenticationError):
        ScramServer("SCRAM-SHA-256", unknown_user_secret=SECRET).first(client_first)


def test_client_final_messages_that_do_not_belong_to_the_exchange_are_refused():
    credential = make_credential("SCRAM-SHA-256", "pencil", salt=SALT, iterations=4096)
    finals = [
        CLIENT_FINAL.replace(b"c=biws", b"c=eSws"),  # channel binding other than client-first's header
        CLIENT_FINAL.replace(b"r=rOpr", b"r=XOpr"),  # another nonce
        CLIENT_FINAL[:-8] + b"AAAAAAA=",  # another proof
        b"c=biws,r=x",  # no proof
        b"c=!!,r=x,p=y",
    ]
    for final in finals:
        server = ScramServer("SCRAM-SHA-256", unknown_user_secret=SECRET, nonce=SERVER_NONCE)
        server.first(CLIENT_FIRST)
        server.server_first(credential)
        with pytest.raises(SaslAuthenticationError):
            server.final(final)
    server = ScramServer("SCRAM-SHA-256", unknown_user_secret=SECRET, nonce=SERVER_NONCE)
    with pytest.raises(SaslAuthenticationError, match="out of turn"):
        server.final(CLIENT_FINAL)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.binary(max_size=300))
def test_any_bytes_end_in_scram_error_or_a_verdict_never_another_exception(first, final):
    server = ScramServer("SCRAM-SHA-512", unknown_user_secret=SECRET)
    try:
        server.first(first)
        server.server_first(make_credential("SCRAM-SHA-512", "pw", iterations=ITERATIONS_MIN))
        server.final(final)
    except SaslAuthenticationError:
        return
    raise AssertionError("random bytes authenticated")
