"""Fetch an image URL from a request without letting the request reach inside the server's network (SSRF).

A prompt's image URL is chosen by whoever sends the request, and the server fetches it from where it runs: next to
cloud metadata endpoints, admin ports and private services. So only http(s), only allowed hosts, only public
addresses, every redirect hop vetted the same way, and the socket pinned to the address that was vetted.
"""

from __future__ import annotations

import functools
import ipaddress
import socket
import ssl
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpcore
import httpx

from quantserve.core.multimodal import Image
from quantserve.errors import InvalidRequestError
from quantserve.vision.images import ImageLimits, decode_image, format_bytes, parse_data_uri, too_big

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_CGNAT = ipaddress.ip_network("100.64.0.0/10")  # RFC 6598 shared address space: a carrier's private network
# RFC 6052's well-known NAT64 prefix; the IPv4 address is the last 32 bits.
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_REDIRECTS = (301, 302, 303, 307, 308)


@dataclass(frozen=True)
class MediaPolicy:
    """Which image URLs the server fetches, and how patiently.

    allowed_domains: empty allows any public host; otherwise only these hostnames and their subdomains
        (--allowed-media-domains). An IP literal listed here (e.g. "127.0.0.1") is fetched even when it is a
        private or loopback address: the operator named that address, so it is trusted (and tests use it to reach
        a local server). A listed *hostname* gets no such exception: its addresses must still be public.
    """

    allow_urls: bool = True  # --no-image-urls turns URL fetching off; data: URIs still work
    allowed_domains: tuple[str, ...] = ()
    timeout: float = 10.0  # seconds, for connecting and for each read
    total_timeout: float = 30.0  # seconds for the whole fetch, redirects included (a slow drip stops here)
    max_redirects: int = 3
    limits: ImageLimits = field(default_factory=ImageLimits)


def _embedded_ipv4(addr: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address inside an IPv4-mapped, 6to4 or NAT64 IPv6 address: the packets go there, so it decides."""
    if not isinstance(addr, ipaddress.IPv6Address):
        return None
    if addr in _NAT64:
        return ipaddress.IPv4Address(int(addr) & 0xFFFFFFFF)
    return addr.ipv4_mapped or addr.sixtofour


def address_refusal(addr: IPAddress) -> str | None:
    """Why `addr` is no place for a server-side fetch ("loopback", "private", …), or None if it is public."""
    embedded = _embedded_ipv4(addr)
    if embedded is not None:
        return address_refusal(embedded)
    for kind in ("loopback", "link_local", "multicast", "unspecified", "reserved", "private"):
        if getattr(addr, f"is_{kind}"):  # link-local includes 169.254.169.254, the cloud metadata service
            return kind.replace("_", "-")
    if addr.version == 4 and addr in _CGNAT:
        return "carrier-grade NAT (100.64.0.0/10)"
    if not addr.is_global:
        return "non-public"
    return None


def _host_allowed(host: str, allowed: tuple[str, ...]) -> bool:
    host = host.lower().rstrip(".")
    host_ip = _ip_or_none(host)
    for entry in allowed:
        entry = entry.lower().strip().removeprefix("*.").strip(".")
        entry_ip = _ip_or_none(entry)
        if host_ip is not None or entry_ip is not None:
            if host_ip is not None and host_ip == entry_ip:
                return True
        elif host == entry or host.endswith("." + entry):
            return True
    return False


def _ip_or_none(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


async def _vet(url: httpx.URL, policy: MediaPolicy, where: str) -> str:
    """The address to connect to for `url`, after every check; raises InvalidRequestError for a refused URL."""
    host = url.host
    if url.scheme not in ("http", "https"):
        scheme = f"'{url.scheme}:'" if url.scheme else "a URL without a scheme"
        raise InvalidRequestError(
            f"{where!r}: only http and https image URLs are fetched, not {scheme}; "
            "send the image as a data: URI",
            param=where,
        )
    if not host:
        raise InvalidRequestError(f"{where!r}: the image URL has no host", param=where)
    if policy.allowed_domains and not _host_allowed(host, policy.allowed_domains):
        raise InvalidRequestError(
            f"{where!r}: images from {host!r} are not allowed on this server (--allowed-media-domains allows "
            f"{', '.join(policy.allowed_domains)}); send the image as a data: URI",
            param=where,
        )
    literal = _ip_or_none(host)
    if literal is not None:
        if policy.allowed_domains:  # an operator-listed IP literal (the only way _host_allowed passes one)
            return str(literal)
        addresses = [literal]
    else:
        port = url.port or (443 if url.scheme == "https" else 80)
        try:  # getaddrinfo blocks; in a thread that a timeout can abandon
            infos = await anyio.to_thread.run_sync(
                functools.partial(socket.getaddrinfo, url.raw_host, port, type=socket.SOCK_STREAM),
                abandon_on_cancel=True,
            )
        except (OSError, UnicodeError):
            raise InvalidRequestError(
                f"{where!r}: the image URL's host {host!r} does not resolve", param=where
            ) from None
        addresses = [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]
    for addr in addresses:  # any bad address refuses the host: the next lookup could return that one
        why = address_refusal(addr)
        if why is not None:
            embedded = _embedded_ipv4(addr)
            shown = f"{addr}, i.e. {embedded}" if embedded else str(addr)
            article = "an" if why[0] in "aeiou" else "a"
            raise InvalidRequestError(
                f"{where!r}: the image URL's host {host!r} is {article} {why} address ({shown}); image URLs must "
                "point to public hosts",
                param=where,
            )
    return str(addresses[0])


class _PinnedBackend(httpcore.AsyncNetworkBackend):
    """Opens every TCP connection to one vetted address, whatever host name the URL has.

    Why this rather than requesting http(s)://<ip>/ with a Host header and an sni_hostname: here the URL keeps its
    real host, so httpcore's Host header, SNI and certificate check (server_hostname = the URL's host, verified by
    ssl with check_hostname=True) are all the defaults, and no second DNS lookup exists that a rebinding attacker
    could answer differently: the only name resolution is the one in `_vet`.
    """

    def __init__(self, address: str):
        self._address = address
        self._inner = httpcore.AnyIOBackend()

    async def connect_tcp(self, host: str, port: int, **kwargs: Any) -> httpcore.AsyncNetworkStream:
        return await self._inner.connect_tcp(self._address, port, **kwargs)  # `host` is ignored on purpose

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    """certifi's roots, hostname checked: httpcore's default."""
    return httpcore.default_ssl_context()


async def _get(url: httpx.URL, address: str, policy: MediaPolicy, where: str) -> bytes | httpx.URL:
    """One GET to `address`: the body, or the URL a redirect points to."""
    t = policy.timeout
    headers = [(b"Host", url.netloc), (b"Accept", b"image/*"), (b"Accept-Encoding", b"identity"),
               (b"User-Agent", b"quantserve")]  # fmt: skip
    target = httpcore.URL(scheme=url.raw_scheme, host=url.raw_host, port=url.port, target=url.raw_path)
    extensions = {"timeout": {"connect": t, "read": t, "write": t, "pool": t}}
    async with (
        httpcore.AsyncConnectionPool(
            ssl_context=_ssl_context(), network_backend=_PinnedBackend(address), retries=0
        ) as pool,
        pool.stream("GET", target, headers=headers, extensions=extensions) as resp,
    ):
        head = {k.lower(): v for k, v in resp.headers}
        if resp.status in _REDIRECTS and b"location" in head:
            try:
                return url.join(head[b"location"].decode("latin-1"))
            except httpx.InvalidURL:
                raise InvalidRequestError(
                    f"{where!r}: {url.host!r} redirected the image URL to an invalid URL", param=where
                ) from None
        if not 200 <= resp.status < 300:
            raise InvalidRequestError(
                f"{where!r}: {url.host!r} answered HTTP {resp.status} for the image URL", param=where
            )
        limit, length = policy.limits.max_bytes, head.get(b"content-length", b"")
        if length.isdigit() and int(length) > limit:  # refused before a byte of the body is read
            raise too_big(where, f"{format_bytes(int(length))} at {url.host!r}", policy.limits)
        body = bytearray()
        async for chunk in resp.aiter_stream():
            body += chunk
            if len(body) > limit:  # stop reading: the rest never arrives
                raise too_big(where, f"more than {format_bytes(limit)} at {url.host!r}", policy.limits)
        return bytes(body)


async def fetch_image(url: str, policy: MediaPolicy, where: str) -> bytes:
    """The bytes at an http(s) image URL, fetched only if the URL and each redirect pass `policy`.

    Raises:
        InvalidRequestError: URLs switched off (policy.allow_urls); a refused scheme, host or address; too many
            redirects; a timeout, connection error or non-2xx status; a body over policy.limits.max_bytes. Never
            anything else for a bad URL or server.
    """
    if not policy.allow_urls:
        raise InvalidRequestError(
            f"{where!r}: image URLs are switched off on this server (--no-image-urls); send the image as a data: URI",
            param=where,
        )
    try:
        current = httpx.URL(url)
    except (httpx.InvalidURL, TypeError):
        raise InvalidRequestError(f"{where!r} is not a valid URL", param=where) from None
    try:
        with anyio.fail_after(policy.total_timeout):
            for _ in range(policy.max_redirects + 1):
                got = await _get(current, await _vet(current, policy, where), policy, where)
                if isinstance(got, bytes):
                    return got
                current = got
    except TimeoutError:
        what = f"took longer than {policy.total_timeout:g}s"
    except httpcore.TimeoutException:
        what = f"timed out (no answer within {policy.timeout:g}s)"
    except (httpcore.NetworkError, httpcore.ProtocolError, httpcore.UnsupportedProtocol, OSError) as e:
        what = f"failed: {type(e).__name__}: {e}" if str(e) else f"failed: {type(e).__name__}"
    else:
        raise InvalidRequestError(
            f"{where!r}: the image URL redirected more than {policy.max_redirects} times", param=where
        )
    raise InvalidRequestError(f"{where!r}: fetching the image from {current.host!r} {what}", param=where)


async def load_image(url: str, policy: MediaPolicy, where: str) -> Image:
    """The Image an OpenAI `image_url.url` names: a data: URI, or an http(s) URL fetched under `policy`.

    Raises:
        InvalidRequestError: for every way the URL, the fetch or the image can be wrong (see fetch_image,
            parse_data_uri, decode_image).
    """
    limits = policy.limits
    if url[:5].lower() == "data:":
        data = await anyio.to_thread.run_sync(parse_data_uri, url, limits, where)
    elif url[:7].lower() == "http://" or url[:8].lower() == "https://":
        data = await fetch_image(url, policy, where)
    else:
        raise InvalidRequestError(
            f"{where!r} must be a data: URI or an http(s) URL, not {url[:16]!r}…", param=where
        )
    return await anyio.to_thread.run_sync(decode_image, data, limits, where)
