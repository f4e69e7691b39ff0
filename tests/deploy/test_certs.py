"""deploy/certs/make-dev-certs.sh: a development CA and certificates that verify, idempotently."""

from __future__ import annotations

import stat

import pytest

from tests.deploy.tools import make_certs, require_tool, run_tool

SERVER_AND_CLIENT = ["controller", "agent", "etcd"]
CLIENT_ONLY = ["trainer", "prometheus"]


def _verify(certs, name: str, purpose: str) -> bool:
    openssl = require_tool("openssl")
    result = run_tool(
        [openssl, "verify", "-purpose", purpose, "-CAfile", str(certs / "ca.pem"),
         str(certs / f"{name}.pem")]
    )
    return result.returncode == 0 and result.stdout.strip().endswith(": OK")


@pytest.mark.parametrize("name", SERVER_AND_CLIENT)
def test_server_certificates_chain_to_the_ca_for_both_purposes(dev_certs, name):
    assert _verify(dev_certs, name, "sslserver")
    assert _verify(dev_certs, name, "sslclient")


@pytest.mark.parametrize("name", CLIENT_ONLY)
def test_client_certificates_are_not_usable_as_servers(dev_certs, name):
    assert _verify(dev_certs, name, "sslclient")
    assert not _verify(dev_certs, name, "sslserver")


def test_certificates_cover_localhost_and_keys_are_private(dev_certs):
    openssl = require_tool("openssl")
    for name in SERVER_AND_CLIENT + CLIENT_ONLY:
        cert = str(dev_certs / f"{name}.pem")
        host = run_tool([openssl, "x509", "-in", cert, "-noout", "-checkhost", "localhost"])
        ip = run_tool([openssl, "x509", "-in", cert, "-noout", "-checkip", "127.0.0.1"])
        assert "does match" in host.stdout and "does match" in ip.stdout, name
        key_mode = stat.S_IMODE((dev_certs / f"{name}-key.pem").stat().st_mode)
        assert key_mode == 0o600, (name, oct(key_mode))
    assert stat.S_IMODE((dev_certs / "ca-key.pem").stat().st_mode) == 0o600


def test_a_certificate_from_another_ca_does_not_verify(dev_certs, tmp_path):
    other = tmp_path / "other"
    assert make_certs(other).returncode == 0
    openssl = require_tool("openssl")
    result = run_tool([openssl, "verify", "-CAfile", str(dev_certs / "ca.pem"), str(other / "agent.pem")])
    assert result.returncode != 0


def test_second_run_changes_nothing_and_new_sans_reissue_only_leaves(tmp_path):
    out = tmp_path / "certs"
    assert make_certs(out).returncode == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    again = make_certs(out)
    assert again.returncode == 0, again.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert "issued" not in again.stderr

    widened = make_certs(out, extra_sans="DNS:ctl1.example.org,IP:10.0.0.11")
    assert widened.returncode == 0, widened.stderr
    after = {p.name: p.read_bytes() for p in out.iterdir()}
    assert after["ca.pem"] == before["ca.pem"]
    assert after["controller.pem"] != before["controller.pem"]
    openssl = require_tool("openssl")
    check = run_tool([openssl, "x509", "-in", str(out / "controller.pem"), "-noout", "-checkip", "10.0.0.11"])
    assert "does match" in check.stdout
    assert _verify(out, "controller", "sslserver")


def test_a_broken_pair_is_reissued(tmp_path):
    out = tmp_path / "certs"
    assert make_certs(out).returncode == 0
    (out / "agent-key.pem").write_bytes((out / "etcd-key.pem").read_bytes())  # key no longer matches
    result = make_certs(out)
    assert result.returncode == 0
    assert "name=agent" in result.stderr and "name=etcd" not in result.stderr
    assert _verify(out, "agent", "sslserver")


def test_an_unsupported_san_is_refused_with_a_message(tmp_path):
    result = make_certs(tmp_path / "certs", extra_sans="URI:spiffe://x")
    assert result.returncode == 2
    assert "unsupported SAN 'URI:spiffe://x'" in result.stderr
