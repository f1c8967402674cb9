"""Images sent by URL: the supervisor fetches each http(s) `image_url` of a chat request (OpenAI's
own, or one translated from Anthropic's or the Responses API's) and puts it in the request as a
`data:` URI, so the engine only ever decodes bytes it was given.

Not a way into the caller's network: a URL whose host resolves to a loopback, private,
link-local, multicast or otherwise reserved address is refused (every address it resolves to,
checked where the connection is made, redirects included, so a DNS answer that changes between a
check and the connection cannot slip one through), unless `[server] image_fetch_private = true`.
A fetch has a deadline (`image_fetch_timeout_s`) and a byte cap (`image_fetch_max_bytes`);
every failure is a 400 naming the part.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ipaddress
import re
import socket
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import yarl
from aiohttp.abc import AbstractResolver, ResolveResult

from mlxd.protocol.errors import APIError
from mlxd.protocol.media import image_url_of
from mlxd.supervisor.registry import ModelEntry, capabilities_of

MAX_REDIRECTS = 5
MAX_URLS = 32  # fetched for one request


def remote_urls(chat: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(where, part) for each image_url part of `chat`'s messages whose URL is http(s)."""
    found = []
    for i, msg in enumerate(chat.get("messages") or []):
        content = msg.get("content") if isinstance(msg, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "image_url":
                url = image_url_of(part)
                if isinstance(url, str) and url[:8].lower().startswith(("http://", "https://")):
                    found.append((f"messages[{i}].content[{j}]", part))
    return found


def check_takes_images(entry: ModelEntry, where: str | None) -> None:
    """A 400 naming the part (`where`, in the caller's API) when the request holds an image and
    the model takes none: said here, in the caller's own terms, before any engine starts."""
    if where is not None and "vision" not in capabilities_of(entry).capabilities:
        raise APIError(400, f"Model {entry.id} does not take images ({where} is an image).", param=where,
                       code="unsupported_content")


# An image part's URL that is http(s), slashes escaped or not ("url": "https:\/\/..." is JSON too).
_HTTP_URL = re.compile(rb'"url"\s*:\s*"[hH][tT][tT][pP][sS]?:(?:\\?/){2}')


def may_hold_urls(body: bytes) -> bool:
    """A cheap look at a raw OpenAI body: whether it may hold an image URL to fetch (one pass of a
    regex, about 0.9 ms over a 3.2 MB body on a 2-core host, where two substring scans took 2.8)."""
    return _HTTP_URL.search(body) is not None


class PublicOnly(AbstractResolver):
    """A resolver that answers only with public addresses (a private one is an error)."""

    def __init__(self) -> None:
        from aiohttp.resolver import DefaultResolver

        self._inner = DefaultResolver()

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        answers = await self._inner.resolve(host, port, family)
        for answer in answers:
            if not is_public(answer["host"]):
                raise PrivateAddress(f"{host} resolves to {answer['host']}, a private or reserved address")
        return answers

    async def close(self) -> None:
        await self._inner.close()


class PrivateAddress(OSError):
    pass


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return False
    return True


def is_public(address: str) -> bool:
    ip = ipaddress.ip_address(address.strip("[]").split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


class ImageFetcher:
    """Fetches the image URLs of chat requests (one aiohttp session, made on first use)."""

    def __init__(self, timeout_s: float, max_bytes: int, allow_private: bool) -> None:
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._max_bytes = max_bytes
        self._allow_private = allow_private
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(resolver=None if self._allow_private else PublicOnly(), limit=16)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout, trust_env=False,
                                                  headers={"User-Agent": "mlxd"})
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def inline(self, chat: dict[str, Any]) -> bool:
        """Replace each http(s) image URL in `chat` with a data: URI of what it serves (all
        fetched at once). Returns whether there were any."""
        found = remote_urls(chat)
        if not found:
            return False
        if len(found) > MAX_URLS:
            raise APIError(400, f"At most {MAX_URLS} image URLs are fetched for one request.", param=found[MAX_URLS][0],
                           code="too_many_images")
        uris = await asyncio.gather(*(self.fetch(image_url_of(part), where) for where, part in found))
        for (_, part), uri in zip(found, uris, strict=True):
            detail = part["image_url"].get("detail") if isinstance(part.get("image_url"), dict) else None
            part["image_url"] = {"url": uri, **({"detail": detail} if detail else {})}
        return True

    async def inline_body(self, body: bytes) -> bytes:
        """A raw OpenAI chat body with its image URLs inlined (the same bytes when it has none)."""
        if not may_hold_urls(body):
            return body
        try:
            chat = msgspec.json.decode(body)
        except msgspec.DecodeError:
            return body  # the engine answers malformed JSON in its own words
        if not isinstance(chat, dict) or not await self.inline(chat):
            return body
        return msgspec.json.encode(chat)

    async def fetch(self, url: str, where: str) -> str:
        """The image at `url` as a data: URI; a 400 naming `where` for whatever goes wrong."""
        def refuse(why: str, code: str = "invalid_image_url") -> APIError:
            return APIError(400, f"The image at {url[:200]} could not be fetched: {why}.", param=where, code=code)

        try:
            async with self._get(url, refuse) as resp:
                if resp.status != 200:
                    raise refuse(f"the server answered {resp.status}")
                if resp.content_length is not None and resp.content_length > self._max_bytes:
                    raise refuse(f"it is {resp.content_length} bytes, over the {self._max_bytes}-byte limit",
                                 "image_too_large")
                data = bytearray()
                async for chunk in resp.content.iter_chunked(1 << 16):
                    data += chunk
                    if len(data) > self._max_bytes:
                        raise refuse(f"it is over the {self._max_bytes}-byte limit", "image_too_large")
                mime = resp.content_type if resp.content_type.startswith("image/") else "application/octet-stream"
        except APIError:
            raise
        except TimeoutError:
            raise refuse(f"no answer within {self._timeout.total:g} s") from None
        except aiohttp.ClientConnectorError as exc:
            if isinstance(exc.os_error, PrivateAddress):
                raise refuse(f"{exc.os_error}; mlxd does not fetch from private addresses "
                             "([server] image_fetch_private allows it)", "image_url_forbidden") from None
            raise refuse(f"cannot connect ({exc.os_error})") from None
        except (aiohttp.ClientError, ValueError) as exc:
            raise refuse(f"{type(exc).__name__}: {exc}") from None
        return f"data:{mime};base64," + base64.b64encode(bytes(data)).decode()

    @contextlib.asynccontextmanager
    async def _get(self, url: str, refuse: Any) -> AsyncIterator[aiohttp.ClientResponse]:
        """GET `url`, following redirects here (each hop's host checked: aiohttp does not ask
        the resolver about an address written in the URL)."""
        for _ in range(MAX_REDIRECTS + 1):
            target = yarl.URL(url)
            if target.scheme not in ("http", "https") or not target.host:
                raise refuse("only http(s) URLs are fetched")
            if not self._allow_private and is_ip(target.host) and not is_public(target.host):
                raise refuse(f"{target.host} is a private or reserved address; mlxd does not fetch from those "
                             "([server] image_fetch_private allows it)", "image_url_forbidden")
            async with self._client().get(target, allow_redirects=False) as resp:
                if resp.status in (301, 302, 303, 307, 308) and "Location" in resp.headers:
                    url = str(target.join(yarl.URL(resp.headers["Location"])))
                    continue
                yield resp
                return
        raise refuse(f"more than {MAX_REDIRECTS} redirects")
