"""The trainers' TLS settings (TPFLEX_TLS_*) are checked and passed through. The demo
story with TLS and tokens on (issue 7) runs in test_demo_story, which asserts the story's
outcome and that the security is really on in one cluster run."""

from __future__ import annotations

import pytest
from tpflex_trainer.hooks.config import HooksConfig, HooksConfigError

_ENV = {"TPFLEX_CONTROLLER": "127.0.0.1:1", "TPFLEX_JOB": "j", "TPFLEX_NODE": "n", "TPFLEX_GPU": "0",
        "TPFLEX_STORE": "127.0.0.1:2", "TPFLEX_JOB_SPEC": "/dev/null"}


@pytest.mark.parametrize(("extra", "message"), [
    ({"TPFLEX_TLS_CA": "/etc/hostname", "TPFLEX_TLS_CERT": "/etc/hostname"}, "go together"),
    ({"TPFLEX_TLS_CERT": "/etc/hostname", "TPFLEX_TLS_KEY": "/etc/hostname"}, "needs TPFLEX_TLS_CA"),
    ({"TPFLEX_TLS_CA": "/nonexistent/ca.pem"}, "TPFLEX_TLS_CA: cannot read"),
])
def test_trainer_tls_settings_are_checked(extra, message):
    with pytest.raises(HooksConfigError, match=message):
        HooksConfig.from_env({**_ENV, **extra})


def test_trainer_tls_settings_pass_through():
    config = HooksConfig.from_env({**_ENV, "TPFLEX_TLS_CA": "/etc/hostname", "TPFLEX_TLS_CERT": "/etc/hostname",
                                   "TPFLEX_TLS_KEY": "/etc/hostname", "TPFLEX_TLS_SERVER_NAME": "ctl"})
    assert (config.tls_ca_file, config.tls_cert_file, config.tls_key_file, config.tls_server_name) == (
        "/etc/hostname", "/etc/hostname", "/etc/hostname", "ctl")
