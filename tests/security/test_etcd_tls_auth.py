"""tpflex's etcd client against a real etcd serving TLS only (client certificates required)
with user/password auth enabled through etcd's Auth API."""

from __future__ import annotations

import threading
import time

import pytest
from tpflex_proto.etcd import EtcdError, EtcdUnavailable

from tests.security.stack import PASSWORDS, SecureEtcd, start_secure_etcd

KEY = "/tpflex/v1/security-test"


@pytest.fixture(scope="module")
def secure_etcd(certs, tmp_path_factory) -> SecureEtcd:
    # a 1 s auth-token TTL: an idle client's token expires quickly (re-authentication test)
    etcd = start_secure_etcd(certs, tmp_path_factory.mktemp("etcd-auth"), auth_token_ttl_s=1)
    try:
        etcd.enable_auth()
        yield etcd
    finally:
        etcd.stop()


def _agent(secure_etcd, password: str = PASSWORDS["tpflex-agent"]):
    return secure_etcd.client(cert="agent", user="tpflex-agent", password=password)


def test_user_with_password_reads_and_writes_under_the_tpflex_prefix(secure_etcd):
    etcd = _agent(secure_etcd)
    try:
        etcd.put(KEY, b"v1")
        assert etcd.get(KEY).value == b"v1"
        lease = etcd.grant_lease(5)
        assert etcd.keepalive_once(lease) > 0
        with pytest.raises(EtcdError, match="permission denied"):
            etcd.put("/outside/tpflex", b"x")  # the role only covers /tpflex/v1/
    finally:
        etcd.close()


def test_wrong_password_and_missing_user_are_refused(secure_etcd):
    etcd = _agent(secure_etcd, password="not-the-password")
    try:
        with pytest.raises(EtcdError, match="authentication failed"):
            etcd.get(KEY)
    finally:
        etcd.close()
    # a trusted certificate whose CN is no etcd user, and no user/password
    etcd = secure_etcd.client(cert="prometheus")
    try:
        with pytest.raises(EtcdError) as exc:
            etcd.put(KEY, b"anonymous")
        assert not isinstance(exc.value, EtcdUnavailable)
        assert "user name is empty" in str(exc.value) or "permission denied" in str(exc.value)
    finally:
        etcd.close()


def test_clients_without_a_trusted_certificate_cannot_connect(secure_etcd, rogue_certs):
    etcd = secure_etcd.client(cert=None, user="tpflex-agent", password=PASSWORDS["tpflex-agent"])
    try:
        with pytest.raises(EtcdUnavailable):
            etcd.get(KEY)
    finally:
        etcd.close()
    rogue = SecureEtcd(rogue_certs, secure_etcd.proc, secure_etcd.endpoint)
    etcd = rogue.client(cert="agent", user="tpflex-agent", password=PASSWORDS["tpflex-agent"])
    try:
        with pytest.raises(EtcdUnavailable):  # the server's certificate is not from our CA
            etcd.get(KEY)
    finally:
        etcd.close()


def test_an_expired_auth_token_is_renewed_transparently(secure_etcd):
    etcd = _agent(secure_etcd)
    try:
        etcd.put(KEY, b"before")
        first = etcd._metadata
        time.sleep(2.5)  # etcd's token TTL (1 s, see the fixture) elapses; no event to await
        etcd.put(KEY, b"after")
        assert etcd.get(KEY).value == b"after"
        assert etcd._metadata != first  # a new token was obtained
    finally:
        etcd.close()


def test_a_watch_the_server_refuses_backs_off_and_is_never_established(secure_etcd):
    """etcd answers a watch outside the user's role with one response that is both
    ``created`` and ``canceled`` (permission denied). That is no working watch: it must not
    count as established, nor reset the back-off (the watch re-created itself every
    25-50 ms, for ever, logging each time)."""
    etcd = _agent(secure_etcd)
    errors: list[float] = []
    failed = threading.Event()

    def on_error(exc):
        errors.append(time.monotonic())
        if len(errors) >= 60:
            failed.set()

    try:
        watch = etcd.watch_prefix("/outside/", lambda events: None, on_error=on_error)
        failed.wait(3.0)  # the spinning watch reaches 60 refusals well within it
        watch.cancel()
        assert errors, "the refused watch reported no error"
        assert not watch.established.is_set()
        # the jittered back-off (0.05 s doubling to 1 s, at least half of each) allows at
        # most 10 tries in 3 s
        assert len(errors) <= 10, f"{len(errors)} refused watches in 3 s"
    finally:
        etcd.close()
