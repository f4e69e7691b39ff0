"""The REST API's error contract, as the tests check it (docs/api.md): a 4xx/5xx answer's
body is exactly ``{"error": {"code": ..., "message": ...}}`` with both non-empty."""

from __future__ import annotations


def rest_error(resp, status: int | None = None, *words: str, code: str | None = None) -> dict:
    """The ``error`` object of ``resp`` (an httpx/requests response), asserted to follow
    the contract; with ``status``, the answer's status is that; with ``words``, each
    appears in the message; with ``code``, the error's code is that."""
    if status is not None:
        assert resp.status_code == status, (resp.status_code, resp.text)
    else:
        assert resp.status_code >= 400, (resp.status_code, resp.text)
    body = resp.json()
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert isinstance(err, dict) and err.get("code") and err.get("message"), body
    if code is not None:
        assert err["code"] == code, body
    for w in words:
        assert w in err["message"], body
    return err
