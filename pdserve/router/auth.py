"""API keys and tenants: who may call the router, and whose prefix cache a request may share.

Where keys come from (``auth:`` in the cluster YAML, or flags): ``tenants.<name>.key_sha256``
(digests, for files kept in git), ``tenants.<name>.key_env`` (environment variables holding
keys), ``keys_file`` (lines of ``TENANT KEY`` or ``TENANT sha256:HEX``), and ``api_key`` /
``PDSERVE_API_KEY`` (one key for everyone, tenant ``default``, as vLLM's ``--api-key``).
``AuthConfig.resolved`` reads them all once, in the process that starts serving, and keeps
only SHA-256 digests: a router (a Ray replica included) never holds a key in the clear.

A request's key is the ``Authorization: Bearer KEY`` header (what the OpenAI SDK sends). It is
hashed and compared with every digest, each in constant time and without stopping at a match,
so an answer's timing tells nothing of how close a guess came. Without keys configured every
request is served (as the tenant ``""``); with keys, every route but ``/health`` and ``/ready``
(and ``/metrics`` with ``metrics_open``) answers 401 in OpenAI's error shape without one.

Cache isolation: the cache salt a worker hashes blocks under is derived here from the tenant
(``cache_salt``), so tenants never share prefix-cache entries (a prefix hit's speed would tell
one tenant what another sent) unless they name the same ``cache_group``; a client's own
``cache_salt`` partitions further within its tenant.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import ipaddress
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from pdserve.configs import ConfigError, doc
from pdserve.router.budgets import Limits

log = logging.getLogger(__name__)

DEFAULT_TENANT = "default"  # the tenant of api_key / PDSERVE_API_KEY
TIERS = ("priority", "default", "flex")  # service classes, most urgent first (router/admission.py)
API_KEY_ENV = "PDSERVE_API_KEY"
OPEN_PATHS = frozenset({"/health", "/ready"})
_DIGEST = re.compile(r"^[0-9a-f]{64}$")
_TENANT = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def key_digest(key: str) -> str:
    """The SHA-256 of an API key, hex: what the configuration and the router keep."""
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class TenantConfig:
    """One tenant: its keys, what it may share, and its budgets (router/budgets.py; 0: no limit)."""

    key_sha256: list[str] = doc(default_factory=list, help="SHA-256 digests (hex) of this tenant's API keys "
                                                           "(`pdserve config digest` prints one)")
    key_env: list[str] = doc(default_factory=list, help="environment variables holding this tenant's API keys, "
                                                        "read and hashed when pdserve starts")
    cache_group: str = doc("", "tenants naming the same group share prefix-cache entries (say, a common system "
                               "prompt); empty: the tenant's own")
    requests_per_minute: int = doc(0, "requests this tenant may send per minute (refilled continuously); past it, "
                                      "429 with Retry-After; 0: no limit")
    tokens_per_minute: int = doc(0, "tokens per minute, reserved when a request is admitted (prompt tokens + "
                                    "max_tokens x n) and given back unused when it ends; 0: no limit")
    max_concurrent_sequences: int = doc(0, "sequences (prompts x n) this tenant may have in flight at once; "
                                           "0: no limit")
    service_tiers: list[str] = doc(default_factory=lambda: ["default", "flex"],
                                   help="the service_tier values this tenant may ask for (priority, default, flex; "
                                        "auto is default): a client cannot raise its own class")

    def __post_init__(self) -> None:
        for key in ("requests_per_minute", "tokens_per_minute", "max_concurrent_sequences"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{key}: must not be negative, got {getattr(self, key)}")
        unknown = sorted(set(self.service_tiers) - set(TIERS))
        if unknown or not self.service_tiers:
            raise ConfigError(f"service_tiers: {unknown or 'none'} given; allowed: {list(TIERS)} (at least one)")

    def limits(self) -> Limits:
        return Limits(self.requests_per_minute, self.tokens_per_minute, self.max_concurrent_sequences)


@dataclass(frozen=True)
class AuthConfig:
    """API keys, each belonging to a tenant. No key anywhere: the API is open (loopback by default)."""

    api_key: str = doc("", "one API key for every client (tenant 'default'), as vLLM's --api-key; the "
                           "PDSERVE_API_KEY environment variable does the same")
    keys_file: str = doc("", "a file of API keys, one per line: TENANT KEY, or TENANT sha256:HEX; '#' starts a "
                             "comment")
    tenants: dict[str, TenantConfig] = doc(default_factory=dict, help="tenants by name: their keys and cache "
                                                                      "sharing")
    metrics_open: bool = doc(False, "with keys configured, serve /metrics without one (a Prometheus scraper "
                                    "inside the cluster)")

    def __post_init__(self) -> None:
        for name, tenant in self.tenants.items():
            if not _TENANT.match(name):
                raise ConfigError(f"auth.tenants: {name!r} is not a tenant name (letters, digits, '_', '.', '-'; "
                                  f"at most 64)")
            for i, digest in enumerate(tenant.key_sha256):
                if not isinstance(digest, str) or not _DIGEST.match(digest):
                    raise ConfigError(f"auth.tenants.{name}.key_sha256[{i}]: expected 64 lowercase hex digits "
                                      f"(a SHA-256), got {digest!r}")

    @property
    def enabled(self) -> bool:
        return any(t.key_sha256 or t.key_env for t in self.tenants.values()) or bool(self.api_key or self.keys_file)

    def resolved(self, environ: Mapping[str, str] | None = None) -> AuthConfig:
        """The same tenants with every key read (environment, file, api_key) and kept only as its
        digest; refused with the key's place named when a source is missing or a key is listed
        for two tenants."""
        environ = os.environ if environ is None else environ
        digests: dict[str, list[str]] = {name: list(t.key_sha256) for name, t in self.tenants.items()}
        for name, tenant in self.tenants.items():
            for var in tenant.key_env:
                if not environ.get(var):
                    raise ConfigError(f"auth.tenants.{name}.key_env: the environment variable {var} is not set "
                                      f"or empty")
                digests[name].append(key_digest(environ[var]))
        for name, digest in _read_keys_file(self.keys_file) if self.keys_file else ():
            digests.setdefault(name, []).append(digest)
        api_key = self.api_key or environ.get(API_KEY_ENV, "")
        if api_key:
            digests.setdefault(DEFAULT_TENANT, []).append(key_digest(api_key))
        owner: dict[str, str] = {}
        for name, keys in digests.items():
            for digest in keys:
                if owner.setdefault(digest, name) != name:
                    raise ConfigError(f"auth: one API key is listed for two tenants ({owner[digest]!r} and "
                                      f"{name!r})")
        tenants = {name: dataclasses.replace(self.tenants.get(name, TenantConfig()), key_sha256=sorted(set(keys)),
                                             key_env=[])
                   for name, keys in digests.items()}
        return dataclasses.replace(self, api_key="", keys_file="", tenants=tenants)


def _read_keys_file(path: str) -> list[tuple[str, str]]:
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ConfigError(f"auth.keys_file: cannot read {path}: {e.strerror}") from e
    entries = []
    for number, line in enumerate(lines, 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) != 2 or not _TENANT.match(fields[0]):
            raise ConfigError(f"auth.keys_file: {path}, line {number}: expected 'TENANT KEY' or "
                              f"'TENANT sha256:HEX'")
        tenant, key = fields
        if key.startswith("sha256:"):
            digest = key.removeprefix("sha256:")
            if not _DIGEST.match(digest):
                raise ConfigError(f"auth.keys_file: {path}, line {number}: sha256: needs 64 lowercase hex digits")
            entries.append((tenant, digest))
        else:
            entries.append((tenant, key_digest(key)))
    return entries


@dataclass(frozen=True)
class Tenant:
    name: str  # "" without keys configured
    cache_group: str
    service_tiers: frozenset[str] = frozenset(TIERS)

    def cache_salt(self, client_salt: str | None) -> str:
        """The salt a worker hashes this request's blocks under: the tenant's group, then the client's
        own salt within it (length-prefixed, so no two (group, salt) pairs give one string). Without
        keys configured, the client's salt as it is."""
        if not self.name:
            return client_salt or ""
        return f"tenant:{len(self.cache_group)}:{self.cache_group}:{client_salt or ''}"


OPEN = Tenant("", "")  # without keys: one tenant, every service tier


class Unauthorized(Exception):
    """No key, or a key no tenant holds; the message is OpenAI's wording for the case."""


class Authenticator:
    """Maps a request's bearer key to its tenant (a resolved AuthConfig: digests only)."""

    def __init__(self, config: AuthConfig):
        self.enabled = config.enabled
        self.metrics_open = config.metrics_open
        self.limits = {name: t.limits() for name, t in config.tenants.items()}  # router/budgets.py
        self._digests = [(bytes.fromhex(d), Tenant(name, t.cache_group or name, frozenset(t.service_tiers)))
                         for name, t in config.tenants.items() for d in t.key_sha256]
        if config.api_key or config.keys_file or any(t.key_env for t in config.tenants.values()):
            raise ValueError("Authenticator needs AuthConfig.resolved(): keys only as digests")

    def needs_key(self, path: str) -> bool:
        return self.enabled and path not in OPEN_PATHS and not (self.metrics_open and path == "/metrics")

    def tenant(self, authorization: str | None) -> Tenant:
        """The tenant of an ``Authorization`` header's bearer key; raises Unauthorized."""
        if not self.enabled:
            return OPEN
        scheme, _, key = (authorization or "").strip().partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise Unauthorized("You didn't provide an API key. You need to provide your API key in an "
                               "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")
        presented = hashlib.sha256(key.encode()).digest()
        found = None
        for digest, tenant in self._digests:  # every digest compared: the time does not depend on which matched
            if hmac.compare_digest(presented, digest):
                found = tenant
        if found is None:
            shown = key[:3] + "*" * 4 + key[-4:] if len(key) > 10 else "*" * len(key)
            raise Unauthorized(f"Incorrect API key provided: {shown}.")
        return found


def warn_if_open(auth: Authenticator, host: str) -> None:
    """Say once, at start, who can reach an API without keys."""
    if auth.enabled:
        return
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if loopback:
        log.info("no API keys configured: the API is open to this machine only (%s); --api-key or auth: in "
                 "--config to require keys", host)
    else:
        log.warning("no API keys configured and the router listens on %s: anyone who can reach it can use it; "
                    "set --api-key (or auth: in --config) or listen on 127.0.0.1", host)
