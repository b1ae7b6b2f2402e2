"""API keys → tenants (DESIGN.md rule 2: a tenant is a namespace; two never share a block).

The key file is a JSON object: each key maps to its namespace, or to
`{"namespace": ..., "ttl_class": ..., "role": "tenant" | "operator", "quota": "512MB", "store": false}`
(`quota`: the namespace's guaranteed share of the block store, bytes or a size; store/quota.py; `"store": false`:
every request of the key is a no-store one, DESIGN rule 12). Only an operator key opens
the operator endpoints (`/metrics`, `/dashboard*`: every tenant's figures and last requests); it is
a tenant too, of its own namespace. Without a key file the server runs open: every request is
the tenant `default`, the operator endpoints are open too (and the server binds to loopback only).

A request's `cache_salt` splits its tenant further: the namespace becomes
`core.salted_namespace(namespace, salt)`, a hash of both (length-prefixed), so no choice of
salt lets one tenant land in another's namespace.
"""

from __future__ import annotations

import hmac
import json
import re
from dataclasses import dataclass
from pathlib import Path

from kvledger.util.private_file import read_private

OPEN_NAMESPACE = "default"
TENANT, OPERATOR = "tenant", "operator"   # the roles of a key
_NAMESPACE = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")


class KeyFileError(ValueError):
    """The API key file cannot be used; the message names the file and the entry."""


@dataclass(frozen=True, slots=True)
class Tenant:
    """Who sends a request: its namespace (rule 2), TTL class (None: the namespace's), key label, role, and
    whether its requests may be stored (False: each is a no-store request, rule 12)."""

    namespace: str
    ttl_class: str | None = None
    label: str = "open"   # what metrics and logs show for the key (never the key itself)
    role: str = TENANT    # OPERATOR: may read the operator endpoints too
    quota: int | None = None   # the namespace's guaranteed bytes of the block store (None: the server's default)
    store: bool = True         # False: every request of the key is a no-store one (rule 12)


OPEN_TENANT = Tenant(OPEN_NAMESPACE)


def load_keys(path: str | Path, known_classes: set[str]) -> dict[str, Tenant]:
    """Parse the key file. Namespaces are plain names ([A-Za-z0-9_.:-], ≤ 128 characters). A file another
    user owns or may write is refused (`private_file.read_private`: a planted key is a planted tenant)."""
    try:
        text = read_private(path, "--api-keys")
    except ValueError as e:
        raise KeyFileError(str(e)) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise KeyFileError(f"{path}: not JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(data, dict) or not data:
        raise KeyFileError(f"{path}: expected a non-empty JSON object mapping each API key to its namespace")
    return {key: _tenant(path, key, value, known_classes) for key, value in data.items()}


def _tenant(path: str | Path, key: str, value: object, known_classes: set[str]) -> Tenant:
    where = f"{path}: key {key[:4]}…"
    if len(key) < 8:
        raise KeyFileError(f"{where}: an API key must have at least 8 characters")
    ttl_class, role, quota, store = None, TENANT, None, True
    if isinstance(value, dict):
        unknown = set(value) - {"namespace", "ttl_class", "role", "quota", "store"}
        if unknown:
            raise KeyFileError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
        namespace, ttl_class, role = value.get("namespace"), value.get("ttl_class"), value.get("role", TENANT)
        quota = _quota(where, value["quota"]) if "quota" in value else None
        store = value.get("store", True)
    else:
        namespace = value
    if not isinstance(namespace, str) or not _NAMESPACE.match(namespace):
        raise KeyFileError(f"{where}: namespace must be a name of [A-Za-z0-9_.:-], 1 to 128 characters")
    if ttl_class is not None and ttl_class not in known_classes:
        raise KeyFileError(f"{where}: unknown ttl_class {ttl_class!r}; known: {', '.join(sorted(known_classes))}")
    if role not in (TENANT, OPERATOR):
        raise KeyFileError(f"{where}: role must be {TENANT!r} or {OPERATOR!r}, not {role!r}")
    if not isinstance(store, bool):
        raise KeyFileError(f"{where}: store must be true or false, not {store!r}")
    return Tenant(namespace, ttl_class, label=namespace, role=role, quota=quota, store=store)


def _quota(where: str, value: object) -> int:
    """A key's `quota`: bytes (an integer) or a size ("512MB", `util.units.parse_size`), finite and ≥ 1."""
    from kvledger.util.units import parse_size

    try:
        size = float(value) if isinstance(value, int) and not isinstance(value, bool) else parse_size(str(value))
    except ValueError:
        size = 0.0
    if not isinstance(value, (int, str)) or isinstance(value, bool) or not 1 <= size < float("inf"):
        raise KeyFileError(f"{where}: quota must be a size such as 512MB or a number of bytes ≥ 1, not {value!r}")
    return int(size)


def tenant_quotas(keys: dict[str, Tenant] | None) -> dict[str, int | None] | None:
    """Each key file namespace → the quota its keys state (the largest where several keys share it; None: none
    stated), for `store.quota.resolve_quotas`; None without a key file."""
    if keys is None:
        return None
    out: dict[str, int | None] = {}
    for t in keys.values():
        have = out.get(t.namespace)
        out[t.namespace] = t.quota if have is None else max(have, t.quota or 0)
    return out


def tenant_count(keys: dict[str, Tenant] | None) -> int:
    """How many tenants a server serves: the namespaces its key file names (keys sharing one are one tenant),
    or 1 when it runs open. Every request's `core.tenant_of(namespace)` is one of them, whatever its salt."""
    return 1 if keys is None else len({tenant.namespace for tenant in keys.values()})


def bearer_token(header: str | None) -> str | None:
    """The KEY of `Authorization: Bearer KEY`, or None."""
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def authenticate(keys: dict[str, Tenant] | None, header: str | None) -> Tenant | None:
    """The tenant of a request; None when keys are configured and this one is missing or wrong.

    Every configured key is compared in constant time (no early exit that times the match)."""
    if keys is None:
        return OPEN_TENANT
    token = bearer_token(header)
    if token is None:
        return None
    found = None
    for key, tenant in keys.items():
        if hmac.compare_digest(key.encode(), token.encode()):
            found = tenant
    return found


def may_operate(keys: dict[str, Tenant] | None, tenant: Tenant) -> bool:
    """Whether `tenant` may read the operator endpoints: anyone on an open (loopback-only) server, else
    an operator key only."""
    return keys is None or tenant.role == OPERATOR
