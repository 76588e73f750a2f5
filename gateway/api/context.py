"""What a route handler takes from its request: the app's services, the request record, the caller's API key.

Plain functions rather than FastAPI `Depends`: the hot routes are called by `app._Dispatcher` directly,
without FastAPI's dependency solving (see `api/table.py`), and the routers' handlers call them the same way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import Request

from gateway.auth import ApiKey
from gateway.errors import AuthenticationError
from gateway.request_record import RequestRecord
from gateway.services import Services

if TYPE_CHECKING:
    from gateway.api.background import BackgroundRuns

_MISSING_KEY = "You didn't provide an API key. Send it as 'Authorization: Bearer sk-...' (or 'x-api-key: sk-...')."


def get_services(request: Request) -> Services:
    """The app's services (built in the lifespan)."""
    services: Services = request.app.state.services
    return services


def get_background(request: Request) -> BackgroundRuns:
    """The app's runs of background responses (started in the lifespan)."""
    runs: BackgroundRuns = request.app.state.background
    return runs


def get_record(request: Request) -> RequestRecord:
    """This request's record, created by the middleware."""
    record: RequestRecord = request.scope["state"]["record"]
    return record


def bearer_token(request: Request) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, else of an `x-api-key` header (what Anthropic's SDK
    sends), or None. A Bearer token wins; an Authorization of another scheme (a proxy's or a browser's `Basic`)
    is not the gateway's and does not hide an `x-api-key`."""
    header = request.headers.get("authorization")
    if header is not None:
        scheme, _, token = header.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    return request.headers.get("x-api-key", "").strip() or None


async def require_api_key(request: Request, services: Services) -> ApiKey | None:
    """The caller's key (None when auth is off); 401 for any bad key, 429 for an address guessing keys.

    A blocked address is not cut off: a key this process already knows to be valid still passes (everyone
    behind one NAT must not lose service to one client's guessing); any other key is answered 429 at once,
    without a Redis lookup, so guesses stay cheap and learn nothing.
    """
    if not services.settings.auth.enabled:
        return None
    client = request.client
    address = client.host if client is not None else "-"
    blocked = services.guard.blocked(address)
    token = bearer_token(request)
    try:
        if token is None:
            raise AuthenticationError(_MISSING_KEY, cause="missing")
        key = await services.keys.authenticate(token, known_only=blocked is not None)
    except AuthenticationError:
        if blocked is not None:
            raise blocked from None
        await services.guard.record_failure(address)
        raise
    get_record(request).key_name = key.name
    return key
