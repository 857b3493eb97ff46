"""Media URLs (off unless --allow-url): http(s) GETs of allow-listed hosts only."""

from __future__ import annotations

import asyncio
import urllib.parse

import httpx

from service.http.errors import item_error
from service.settings import ServeSettings
from service.version import VERSION


class UrlFetcher:
    """http(s) GET of allow-listed hosts only: no redirects (one could leave the allow-list), no proxies
    from the environment, size-capped while reading, one deadline for the whole fetch.

    Fetches run on the event loop, so a slow host holds only its own request: when the fetch's deadline or
    the request's passes, or its client leaves, the fetch is cancelled and its connection closed."""

    def __init__(self, settings: ServeSettings) -> None:
        self.allowed = set(settings.allowed_hosts)
        self.max_bytes = settings.max_payload_bytes
        self.timeout = settings.url_timeout_s
        self.client = httpx.AsyncClient(
            follow_redirects=False, trust_env=False, timeout=self.timeout,
            limits=httpx.Limits(max_connections=settings.max_concurrent_requests, max_keepalive_connections=16),
            # the bytes as sent: a compressed body is never inflated here, past the size cap
            headers={"User-Agent": f"vitserve/{VERSION}", "Accept-Encoding": "identity"})

    async def close(self) -> None:
        await self.client.aclose()

    def host_allowed(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        return any(host == h or (h.startswith("*.") and host.endswith(h[1:])) for h in self.allowed)

    def check(self, url: str, index: int) -> None:
        try:
            parts = urllib.parse.urlsplit(url)
            host = parts.hostname or ""
            parts.port  # noqa: B018 - raises ValueError for a bad port
        except ValueError as exc:
            raise item_error(index, f"invalid URL: {exc}", "invalid_url") from None
        if parts.scheme not in ("http", "https"):
            raise item_error(index, "only http and https URLs are fetched", "url_not_allowed")
        if not self.host_allowed(host):
            raise item_error(index, f"host {host!r} is not in --allowed-hosts", "url_not_allowed")

    async def fetch(self, url: str, index: int) -> bytes:
        self.check(url, index)
        try:
            return await asyncio.wait_for(self._get(url, index), self.timeout)
        except (asyncio.TimeoutError, TimeoutError, httpx.TimeoutException):
            raise item_error(index, f"fetching the URL took longer than {self.timeout:g}s",
                             "fetch_timeout") from None

    async def _get(self, url: str, index: int) -> bytes:
        try:
            async with self.client.stream("GET", url) as resp:
                if resp.status_code != 200:
                    raise item_error(index, f"fetching the URL returned HTTP {resp.status_code}", "fetch_failed")
                length = resp.headers.get("content-length")
                if length and length.isdigit() and int(length) > self.max_bytes:
                    raise item_error(index, f"the URL's content is {length} bytes, above the limit of "
                                            f"{self.max_bytes}", "too_large")
                data = bytearray()
                async for chunk in resp.aiter_raw():
                    data += chunk
                    if len(data) > self.max_bytes:
                        raise item_error(index, f"the URL's content is above the limit of {self.max_bytes} bytes",
                                         "too_large")
                return bytes(data)
        except httpx.TimeoutException:
            raise
        except (httpx.HTTPError, OSError) as exc:
            raise item_error(index, f"fetching the URL failed: {type(exc).__name__}", "fetch_failed") from None
