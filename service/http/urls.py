"""Media URLs (off unless --allow-url): http(s) GETs of allow-listed hosts only."""

from __future__ import annotations

import asyncio
import http.client
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import Executor
from typing import Any

from service.http.errors import ApiError, item_error
from service.settings import ServeSettings
from service.version import VERSION


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # a 3xx becomes an HTTPError: a redirect could leave the allow-list


class UrlFetcher:
    """http(s) GET of allow-listed hosts only: no redirects, no proxies from the environment, no
    other schemes (the opener has no file/ftp/data handlers), size-capped, with a total timeout.
    Blocking urllib in the worker pool keeps the server free of an HTTP-client dependency."""

    def __init__(self, settings: ServeSettings, pool: Executor) -> None:
        self.allowed = set(settings.allowed_hosts)
        self.max_bytes = settings.max_payload_bytes
        self.timeout = settings.url_timeout_s
        self.pool = pool
        self.opener = urllib.request.OpenerDirector()
        for handler in (urllib.request.HTTPHandler(), urllib.request.HTTPSHandler(),
                        urllib.request.HTTPDefaultErrorHandler(), _NoRedirect(), urllib.request.HTTPErrorProcessor()):
            self.opener.add_handler(handler)

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
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(loop.run_in_executor(self.pool, self._get, url, index), self.timeout + 1)
        except (asyncio.TimeoutError, TimeoutError):
            raise self._timeout(index) from None

    def _timeout(self, index: int) -> ApiError:
        return item_error(index, f"fetching the URL took longer than {self.timeout:g}s", "fetch_timeout")

    def _get(self, url: str, index: int) -> bytes:
        deadline = time.monotonic() + self.timeout
        request = urllib.request.Request(url, headers={"User-Agent": f"vitserve/{VERSION}"})
        try:
            with self.opener.open(request, timeout=self.timeout) as resp:
                length = resp.headers.get("content-length")
                if length and length.isdigit() and int(length) > self.max_bytes:
                    raise item_error(index, f"the URL's content is {length} bytes, above the limit of "
                                            f"{self.max_bytes}", "too_large")
                data = bytearray()
                while chunk := resp.read(1 << 16):
                    data += chunk
                    if len(data) > self.max_bytes:
                        raise item_error(index, f"the URL's content is above the limit of {self.max_bytes} bytes",
                                         "too_large")
                    if time.monotonic() > deadline:
                        raise self._timeout(index)
                return bytes(data)
        except urllib.error.HTTPError as exc:
            raise item_error(index, f"fetching the URL returned HTTP {exc.code}", "fetch_failed") from None
        except (OSError, http.client.HTTPException) as exc:
            if isinstance(exc, TimeoutError) or isinstance(getattr(exc, "reason", None), TimeoutError):
                raise self._timeout(index) from None
            raise item_error(index, f"fetching the URL failed: {type(exc).__name__}", "fetch_failed") from None

