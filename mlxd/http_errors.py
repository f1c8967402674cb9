"""Error middleware shared by engine and supervisor (aiohttp, so not in protocol/): every failure leaves as API-format JSON."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.typedefs import Middleware

from mlxd.protocol.errors import APIError, encode_openai_error

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def make_error_middleware(
    component: str, render: Callable[[web.Request, APIError], web.Response] | None = None
) -> Middleware:
    """A middleware turning APIError, aiohttp's HTTP errors and anything unexpected into JSON
    (OpenAI's format, or what `render` makes of the error for the request)."""
    log = logging.getLogger(f"mlxd.{component}")
    out = render or (lambda request, err: error_response(err))

    @web.middleware
    async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except APIError as err:
            return out(request, err)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return out(request, http_error(exc))
        except Exception:
            log.exception("unhandled error on %s %s", request.method, request.path)
            return out(request, APIError(500, f"Internal error in the {component}.", type="server_error"))

    return error_middleware


def http_error(exc: web.HTTPException) -> APIError:
    """aiohttp's own 404/405/413 as API errors."""
    if exc.status == 413:
        return APIError(413, f"Request body too large: {exc.text}", code="request_too_large")
    if exc.status == 404:
        return APIError(404, "Unknown route.", code="not_found")
    allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
    return APIError(exc.status, exc.reason, code=exc.reason.lower().replace(" ", "_"), headers=allow)


def error_response(err: APIError) -> web.Response:
    """The JSON response for an APIError (OpenAI's format)."""
    return web.Response(
        status=err.status, body=encode_openai_error(err), content_type="application/json", headers=err.headers
    )
