"""API keys. With ``--api-key``, user routes need ``Authorization: Bearer KEY``; admin routes (the
ones that change what other users get) need ``--admin-api-key``, which also works as a user key,
and answer 403 naming that flag when it was not given. Keys are compared as SHA-256 digests with
``hmac.compare_digest``, against every configured key, so timing tells nothing about them.
``GET /v1/auth`` tells a client (the playground) what its key may do."""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

from fastapi import APIRouter, Depends, Request

from steerable.entrypoints.openai.errors import APIError

USER, ADMIN = "user", "admin"


class Keys:
    def __init__(self, user_keys: list[str], admin_key: str | None):
        self.user = [_digest(key) for key in user_keys]
        self.admin = _digest(admin_key) if admin_key else None

    def role(self, authorization: str | None) -> str | None:
        """ADMIN, USER or None for the bearer token of an ``Authorization`` header."""
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        digest = _digest(token.strip())
        is_admin = self.admin is not None and hmac.compare_digest(digest, self.admin)
        is_user = [hmac.compare_digest(digest, key) for key in self.user]  # all of them, always
        if is_admin:
            return ADMIN
        return USER if any(is_user) else None


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


async def require_user(request: Request) -> None:
    """FastAPI dependency of the user routes: open without ``--api-key``."""
    keys: Keys = request.app.state.server.keys
    if keys.user and keys.role(request.headers.get("authorization")) is None:
        raise APIError(401, "a valid API key is required: send 'Authorization: Bearer KEY'")


async def require_admin(request: Request) -> None:
    """FastAPI dependency of the admin routes."""
    keys: Keys = request.app.state.server.keys
    if keys.admin is None:
        raise APIError(403, "admin routes are disabled; start the server with --admin-api-key to enable them")
    role = keys.role(request.headers.get("authorization"))
    if role == USER:
        raise APIError(403, "this route changes what every user gets and needs the admin key (--admin-api-key)")
    if role is None:
        raise APIError(401, "the admin key is required: send 'Authorization: Bearer ADMIN_KEY'")


router = APIRouter(dependencies=[Depends(require_user)])


@router.get("/v1/auth")
async def whoami(request: Request) -> dict[str, Any]:
    """``role``: "admin" for the admin key, else "user" (any key that passed, or none on an open
    server); ``admin_routes``: whether the server has admin routes at all (``--admin-api-key``)."""
    keys: Keys = request.app.state.server.keys
    role = keys.role(request.headers.get("authorization"))
    return {"role": ADMIN if role == ADMIN else USER, "admin_routes": keys.admin is not None}
