"""Who may call what: client API keys on the OpenAI endpoints, the admin token on /admin. Both are bearer
tokens compared in constant time; they are separate, so a client key never opens the admin API.

    keys = client_keys(settings.api_keys)                     # once, when the app is built
    authorize_client(scope["headers"], keys)                  # raises Unauthorized (401) when keys are set
    key_tier(scope["headers"], {b"sk-batch": "flex"})         # an authorized key's default service tier, or None
    authorize_admin(request.headers.get("authorization"), settings.admin_token)
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping

from crossover.gateway.errors import AdminDisabled, AuthenticationFailed, Unauthorized


def bearer_token(authorization: bytes | str | None) -> bytes | None:
    if not authorization:
        return None
    raw = authorization.encode("latin-1") if isinstance(authorization, str) else authorization
    scheme, _, token = raw.partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else None


def _matches(given: bytes | None, keys: list[bytes]) -> bool:
    # Compare against every key, so the time taken says nothing about which key came close.
    matched = False
    for key in keys:
        matched |= secrets.compare_digest(given or b"", key)
    return matched and given is not None


def client_keys(api_keys: list[str]) -> list[bytes]:
    """`settings.api_keys` as `authorize_client` compares them."""
    return [key.encode() for key in api_keys]


def authorize_client(headers: list[tuple[bytes, bytes]], keys: list[bytes]) -> None:
    if not keys:
        return
    given = bearer_token(next((value for name, value in headers if name == b"authorization"), None))
    if not _matches(given, keys):
        raise Unauthorized("missing or invalid API key: send 'Authorization: Bearer <key>'")


def key_tier(headers: list[tuple[bytes, bytes]], tiers: dict[bytes, str]) -> str | None:
    """The default service tier of the key the request carries (`settings.api_key_tiers`), or None. Asked only
    after `authorize_client` accepted the key: a lookup by it says nothing to a caller who does not hold it."""
    return tiers.get(bearer_token(next((value for name, value in headers if name == b"authorization"), None)) or b"")


def key_tiers(api_key_tiers: Mapping[str, str]) -> dict[bytes, str]:
    """`settings.api_key_tiers` as `key_tier` looks them up."""
    return {key.encode(): tier for key, tier in api_key_tiers.items()}


def authorize_admin(authorization: str | None, token: str) -> None:
    if not token:
        raise AdminDisabled("the admin API is disabled: configure admin_token to enable it")
    if not _matches(bearer_token(authorization), [token.encode()]):
        raise AuthenticationFailed("missing or wrong admin token: send 'Authorization: Bearer <admin_token>'")
