"""Image sources -> family ImageInputs, off the event loop.

Sources (the `url` of an `image_url` part):
- ``data:image/<type>;base64,...`` -- decoded by `mmjax.image.decode` (png, jpeg, webp, gif, bmp, ...).
- ``http://`` / ``https://`` -- fetched with aiohttp: total timeout, byte cap (Content-Length and
  streamed count), at most `max_redirects` redirects, each hop re-checked. The host is resolved
  and EVERY resolved address must be public: loopback, private (RFC 1918 / ULA), link-local
  (cloud metadata 169.254.169.254), multicast, reserved and unspecified addresses are refused
  unless `allow_private_urls` (``--allow-private-media-urls``). The connection itself goes
  through a resolver that re-applies the check, so a DNS answer that changes between the check
  and the connect (rebinding) cannot reach a private address. With `allowed_domains` set, only
  those hosts (exact names or IP literals; ``*.example.com`` for subdomains) may be fetched.
  Environment proxies are ignored.
- ``file://`` URLs -- only when `allowed_local_path` is set, and only for files whose real path
  (symlinks resolved) lies under it.

Decoding, validation and resizing (`mmjax.image.load_image` + the family's `prepare_image`) run in a thread
pool, so a large image never blocks other clients.
"""
from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urljoin, urlsplit

import aiohttp
from aiohttp.abc import AbstractResolver

from mmjax.errors import ContextLengthError, ImageError, ImageTooLargeError, InvalidRequestError
from mmjax.image.decode import ImageLimits, load_image
from mmjax.models.family import ImageOptions


class MediaForbiddenError(InvalidRequestError):
    code = "media_url_forbidden"


class MediaFetchError(InvalidRequestError):
    code = "media_fetch_failed"


@dataclass
class MediaConfig:
    limits: ImageLimits = ImageLimits()
    allowed_local_path: str | None = None
    allowed_domains: tuple[str, ...] = ()
    allow_private_urls: bool = False
    fetch_timeout: float = 10.0
    max_redirects: int = 3
    image_max_tokens: int | None = None     # per-image token budget
    low_detail_tokens: int = 256            # resolution budget of detail="low" (dynamic-res families)


def ip_forbidden(ip: str) -> bool:
    a = ipaddress.ip_address(ip.split("%", 1)[0])
    if isinstance(a, ipaddress.IPv6Address) and a.ipv4_mapped is not None:
        a = a.ipv4_mapped
    return (a.is_private or a.is_loopback or a.is_link_local or a.is_multicast or a.is_reserved
            or a.is_unspecified or not a.is_global)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
        return True
    except ValueError:
        return False


class ForbiddenAddress(OSError):
    """Raised by GuardedResolver (an OSError so aiohttp's connector passes it through)."""


class GuardedResolver(AbstractResolver):
    """aiohttp resolver that refuses hosts resolving to any non-public address."""

    def __init__(self, allow_private: bool):
        self.allow_private = allow_private
        self._inner = aiohttp.ThreadedResolver()

    async def resolve(self, host: str, port: int = 0, family: int = socket.AF_INET):
        infos = await self._inner.resolve(host, port, family)
        if not self.allow_private:
            for info in infos:
                if ip_forbidden(info["host"]):
                    raise ForbiddenAddress(f"image URL host {host!r} resolves to a non-public address "
                                           f"{info['host']} (--allow-private-media-urls allows it)")
        return infos

    async def close(self) -> None:
        await self._inner.close()


class MediaFetcher:
    def __init__(self, cfg: MediaConfig, family, executor):
        self.cfg = cfg
        self.family = family
        self.executor = executor
        self._session: aiohttp.ClientSession | None = None

    # ---- lifecycle ----------------------------------------------------------------------------
    async def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            conn = aiohttp.TCPConnector(resolver=GuardedResolver(self.cfg.allow_private_urls), limit=32,
                                        use_dns_cache=False)
            self._session = aiohttp.ClientSession(
                connector=conn, trust_env=False, auto_decompress=True,
                timeout=aiohttp.ClientTimeout(total=self.cfg.fetch_timeout),
                headers={"User-Agent": "mmjax-serve/0.1"})
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    # ---- sources --------------------------------------------------------------------------------
    async def load(self, ref) -> Any:
        """ImageRef -> ImageInput (raises typed errors naming ref.param)."""
        url = ref.url
        try:
            scheme = url.split(":", 1)[0].lower() if ":" in url else ""
            if scheme == "data":
                source: Any = url          # mmjax.image decodes it (byte cap before the base64 decode)
            elif scheme in ("http", "https"):
                source = await self.fetch(url)
            elif scheme == "file":
                source = self.local_path(url)
            else:
                raise ImageError("image URL must be a data: URI, an http(s) URL or (when the server allows "
                                 f"local media) a file:// URL; got scheme {scheme or 'none'!r}")
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self.executor, self._prepare, source, ref.detail)
        except InvalidRequestError as e:
            if e.param == "image_max_tokens" and isinstance(e, ContextLengthError):
                e.code = "image_token_budget_exceeded"
            if e.param in (None, "image_url", "images", "image_max_tokens"):
                e.param = ref.param
            raise

    def _prepare(self, source: Any, detail: str):
        img = load_image(source, self.cfg.limits)
        im = self.family.prepare_image(img, self._options(detail))
        budget = self.cfg.image_max_tokens
        if budget is not None and im.num_tokens > budget:
            raise ContextLengthError(f"image needs {im.num_tokens} tokens, over the per-image budget of {budget} "
                                     "(--image-max-tokens)", code="image_token_budget_exceeded")
        return im

    def _options(self, detail: str) -> ImageOptions:
        """detail -> the family's options for the token budget (dynamic-resolution families
        resize to fit it; fixed-size families have one size, so detail is a no-op there)."""
        tokens = self.cfg.image_max_tokens
        if detail == "low":
            tokens = min(tokens or self.cfg.low_detail_tokens, self.cfg.low_detail_tokens)
        return self.family.fit_options(tokens) if tokens else ImageOptions()

    def local_path(self, url: str) -> str:
        root = self.cfg.allowed_local_path
        if not root:
            raise MediaForbiddenError("file:// image URLs are disabled (start the server with "
                                      "--allowed-local-media-path DIR)", code="local_media_forbidden")
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise MediaForbiddenError("file:// URLs must not name a host", code="local_media_forbidden")
        path = os.path.realpath(unquote(parts.path))
        root_real = os.path.realpath(root)
        if os.path.commonpath([path, root_real]) != root_real:
            raise MediaForbiddenError("file:// image is outside --allowed-local-media-path",
                                      code="local_media_forbidden")
        return path

    def _check_host(self, host: str | None) -> None:
        if not host:
            raise MediaFetchError("image URL has no host")
        host = host.lower().rstrip(".")
        doms = self.cfg.allowed_domains
        if doms and not any(host == d or (d.startswith("*.") and host.endswith(d[1:])) for d in doms):
            raise MediaForbiddenError(f"image URL host {host!r} is not in --allowed-media-domains")

    async def _check_ips(self, host: str, port: int) -> None:
        if self.cfg.allow_private_urls:
            return
        if _is_ip(host):
            ips = [host]
        else:
            try:
                infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError as e:
                raise MediaFetchError(f"cannot resolve image URL host {host!r}: {e}") from None
            ips = [i[4][0] for i in infos]
        if not ips or any(ip_forbidden(ip) for ip in ips):
            raise MediaForbiddenError(f"image URL host {host!r} is a private, loopback or link-local address "
                                      "(start the server with --allow-private-media-urls to allow it)")

    async def fetch(self, url: str) -> bytes:
        cap = self.cfg.limits.max_bytes
        session = await self.session()
        try:
            for _hop in range(self.cfg.max_redirects + 1):
                parts = urlsplit(url)
                if parts.scheme.lower() not in ("http", "https"):
                    raise MediaFetchError(f"image URL redirected to a non-http(s) URL ({parts.scheme!r})")
                host = parts.hostname
                self._check_host(host)
                await self._check_ips(host, parts.port or (443 if parts.scheme.lower() == "https" else 80))
                async with session.get(url, allow_redirects=False) as resp:
                    if resp.status in (301, 302, 303, 307, 308):
                        loc = resp.headers.get("Location")
                        if not loc:
                            raise MediaFetchError(f"image URL answered {resp.status} without a Location")
                        url = urljoin(url, loc)
                        continue
                    if resp.status != 200:
                        raise MediaFetchError(f"fetching the image URL failed: HTTP {resp.status}")
                    if resp.content_length is not None and resp.content_length > cap:
                        raise ImageTooLargeError(f"image is {resp.content_length} bytes, over the limit of "
                                                 f"{cap} bytes")
                    buf = bytearray()
                    async for chunk in resp.content.iter_chunked(65536):
                        buf += chunk
                        if len(buf) > cap:
                            raise ImageTooLargeError(f"image is over the limit of {cap} bytes")
                    return bytes(buf)
            raise MediaFetchError(f"image URL redirected more than {self.cfg.max_redirects} times")
        except asyncio.TimeoutError:
            raise MediaFetchError(f"fetching the image URL timed out after {self.cfg.fetch_timeout}s") from None
        except aiohttp.ClientConnectorError as e:
            inner = getattr(e, "os_error", None) or e.__cause__
            if isinstance(inner, ForbiddenAddress):
                raise MediaForbiddenError(str(inner)) from None
            raise MediaFetchError(f"cannot connect to the image URL host: {e}") from None
        except aiohttp.ClientError as e:
            raise MediaFetchError(f"fetching the image URL failed: {type(e).__name__}: {e}") from None
        except ForbiddenAddress as e:
            raise MediaForbiddenError(str(e)) from None
        except (ValueError, UnicodeError) as e:
            raise MediaFetchError(f"invalid image URL: {e}") from None


__all__ = ["MediaConfig", "MediaFetcher", "MediaForbiddenError", "MediaFetchError", "ip_forbidden",
           "GuardedResolver"]
