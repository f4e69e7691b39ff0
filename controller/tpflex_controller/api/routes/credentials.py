"""A job's trainer credentials (docs/deploy.md, "Trust model"): list them (names, who
issued them, when; never a secret), issue one (the secret is in the answer once: hand it
to the job's tpflex-run with --job-credential-file), revoke one. Admin only, within the
token's jobs= limit. Registering the job with an admin token (tpflex-run
--register-token-file) issues credentials too; deleting the job revokes them all."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path
from pydantic import BaseModel, Field

from tpflex_controller.api.deps import Admin, Deps, check_job_limit
from tpflex_controller.api.errors import invalid, not_found
from tpflex_controller.api.params import JobName
from tpflex_controller.credentials import NAME_PATTERN, CredentialError, Credentials

router = APIRouter(prefix="/jobs", tags=["jobs"])

CredentialName = Annotated[str, Path(pattern=f"^{NAME_PATTERN.pattern}$",
                                     description="credential name (1-64 of A-Z a-z 0-9 . _ -)")]


class CredentialView(BaseModel):
    name: str
    issued_at: float
    issued_by: str


class CredentialRequest(BaseModel):
    name: str = Field(pattern=f"^{NAME_PATTERN.pattern}$", description="e.g. node-<node>; issuing "
                      "a name again replaces its secret (the old one stops working)")


class CredentialIssued(CredentialView):
    job: str
    credential: str = Field(description="the secret, shown this once: tpjc:<job>:<name>:<secret>")


class CredentialRevoked(BaseModel):
    job: str
    name: str
    revoked: bool = True
    note: str = "calls with it are refused within 1 s on every controller replica"


def _credentials(deps) -> Credentials:
    return Credentials(deps.etcd)


@router.get("/{job}/credentials", response_model=list[CredentialView],
            summary="The job's trainer credentials (admin): names, issuer, time; no secrets")
def list_credentials(job: JobName, deps: Deps, caller: Admin) -> list[CredentialView]:
    if deps.store.job(job) is None:
        raise not_found(f"job {job!r} not found")
    return [CredentialView(name=c.name, issued_at=c.issued_at, issued_by=c.issued_by)
            for c in _credentials(deps).list(job)]


@router.post("/{job}/credentials", response_model=CredentialIssued, status_code=201,
             summary="Issue a trainer credential of the job (admin); the secret is shown once")
def issue_credential(job: JobName, body: CredentialRequest, deps: Deps, caller: Admin) -> CredentialIssued:
    check_job_limit(caller, job)
    at = deps.clock()
    try:
        token = _credentials(deps).issue(job, body.name, f"operator:{caller.name}", at=at)
    except CredentialError as exc:
        if "not registered" in str(exc):
            raise not_found(f"job {job!r} not found") from None
        raise invalid(str(exc)) from None
    return CredentialIssued(job=job, name=body.name, issued_at=at, issued_by=f"operator:{caller.name}",
                            credential=token)


@router.delete("/{job}/credentials/{name}", response_model=CredentialRevoked,
               summary="Revoke one trainer credential of the job (admin)")
def revoke_credential(job: JobName, name: CredentialName, deps: Deps, caller: Admin) -> CredentialRevoked:
    check_job_limit(caller, job)
    if not _credentials(deps).revoke(job, name):
        raise not_found(f"job {job!r} has no credential {name!r}")
    return CredentialRevoked(job=job, name=name)
