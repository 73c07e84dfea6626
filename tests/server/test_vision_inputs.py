"""Image inputs: decoding limits, data: URIs, the SSRF guard and fetches from a local server, and LLaVA
preprocessing checked against transformers' own image processors on the same bytes. No network, no GPU."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import json
import shutil
import socket
import ssl
import struct
import subprocess
import threading
import time
import warnings
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpcore
import numpy as np
import pytest
from PIL import Image as PILImage

from quantserve.errors import InvalidRequestError
from quantserve.vision import fetch as fetch_mod
from quantserve.vision.fetch import MediaPolicy, address_refusal, fetch_image, load_image
from quantserve.vision.images import ImageLimits, check_image_count, decode_image, parse_data_uri
from quantserve.vision.preprocess import ImageProcessorConfig, pixel_values
from tests.fixtures.vision import LLAVA_PROCESSOR, sample_images

W = "messages[0].content[1]"

# ---- test images ---------------------------------------------------------------------------------------------


def _encode(im: PILImage.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format=fmt, **kw)
    return buf.getvalue()


def _extra_images() -> dict[str, bytes]:
    """Modes that need converting to RGB: alpha (composited on white), greyscale, palettes with transparency."""
    rng = np.random.default_rng(1)
    rgba = rng.integers(0, 256, (211, 150, 4), dtype=np.uint8)
    rgba[:40, :, 3] = 0  # a fully transparent band: must come out white
    grey = rng.integers(0, 256, (120, 257), dtype=np.uint8)
    pal = PILImage.fromarray(rng.integers(0, 256, (77, 190, 3), dtype=np.uint8)).quantize(64)
    la = np.stack([grey, rng.integers(0, 256, grey.shape, dtype=np.uint8)], axis=-1)
    return {
        "rgba.png": _encode(PILImage.fromarray(rgba, "RGBA"), "PNG"),
        "grey.png": _encode(PILImage.fromarray(grey, "L"), "PNG"),
        "grey.jpg": _encode(PILImage.fromarray(grey, "L"), "JPEG"),
        "la.png": _encode(PILImage.fromarray(la, "LA"), "PNG"),
        "palette.gif": _encode(pal, "GIF", transparency=5),
        "palette.png": _encode(pal, "PNG", transparency=7),
    }


IMAGES = {**sample_images(), **_extra_images()}

# ---- preprocessing against transformers ----------------------------------------------------------------------

CONFIGS = {
    "llava-pad": LLAVA_PROCESSOR,
    "clip-nopad": {**LLAVA_PROCESSOR, "image_processor_type": "CLIPImageProcessor", "do_pad": False},
    # crop bigger than the resized image: transformers zero-pads inside its centre crop
    "small-resize": {**LLAVA_PROCESSOR, "do_pad": False, "size": {"shortest_edge": 200}, "crop_size": 224},
}


@pytest.fixture(scope="module")
def processors(tmp_path_factory) -> dict[str, tuple[object, ImageProcessorConfig]]:
    transformers = pytest.importorskip("transformers")
    out = {}
    for name, d in CONFIGS.items():
        model_dir = tmp_path_factory.mktemp(name)
        (model_dir / "preprocessor_config.json").write_text(json.dumps(d))
        if d["image_processor_type"] == "CLIPImageProcessor":
            ref = transformers.CLIPImageProcessor.from_pretrained(model_dir)
        else:  # LlavaImageProcessorPil here, as torchvision is not installed
            ref = transformers.AutoImageProcessor.from_pretrained(model_dir)
        out[name] = (ref, ImageProcessorConfig.from_dir(model_dir))
    return out


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("name", IMAGES)
def test_pixel_values_match_transformers(processors, config, name):
    ref_proc, cfg = processors[config]
    data = IMAGES[name]
    ref = ref_proc(images=PILImage.open(io.BytesIO(data)), return_tensors="np")["pixel_values"][0]
    ours = pixel_values(decode_image(data, ImageLimits(), W), cfg)
    assert ours.dtype == np.float32 and ours.shape == ref.shape == (3, *cfg.crop_size)
    assert np.abs(ours - ref).max() <= 1e-5


def test_processor_config_defaults_and_old_forms(tmp_path):
    assert ImageProcessorConfig.from_dir(tmp_path) == ImageProcessorConfig()  # no file: llava-hf's values
    cfg = ImageProcessorConfig.from_dict({"size": 224, "crop_size": 224, "do_pad": True})
    assert (cfg.shortest_edge, cfg.crop_size, cfg.do_pad) == (224, (224, 224), True)
    cfg = ImageProcessorConfig.from_dict({"size": {"height": 100, "width": 120}})
    assert (cfg.shortest_edge, cfg.resize_to) == (None, (100, 120))


def test_decoded_pixels_are_rgb_like_transformers():
    rgba = decode_image(IMAGES["rgba.png"], ImageLimits(), W)
    assert rgba.rgb.shape == (211, 150, 3) and rgba.rgb.dtype == np.uint8
    assert (rgba.rgb[:40] == 255).all()  # transparent -> white, not black
    assert rgba.digest == hashlib.sha256(IMAGES["rgba.png"]).digest()
    for name in ("palette.gif", "palette.png"):
        decoded = decode_image(IMAGES[name], ImageLimits(), W)
        pal = PILImage.open(io.BytesIO(IMAGES[name]))
        transparent = np.asarray(pal) == pal.info["transparency"]
        assert transparent.any() and (decoded.rgb[transparent] == 255).all()


# ---- decode limits and data: URIs ------------------------------------------------------------------------------


def _png_header(width: int, height: int) -> bytes:
    """A PNG that claims width x height in its IHDR (valid CRC) and carries almost no data: a few dozen bytes."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0" * 64))
        + chunk(b"IEND", b"")
    )


def _gif_with_huge_first_frame() -> bytes:
    """A 1x1 GIF whose first frame is 65535x65535: Pillow's own bomb check fires while opening it."""
    screen = b"GIF89a" + struct.pack("<HHBBB", 1, 1, 0, 0, 0)
    frame = b"," + struct.pack("<HHHHB", 0, 0, 65535, 65535, 0) + b"\x02\x02\x44\x01\x00;"
    return screen + frame


def _raises(fn, *args, match: str) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as e:
        fn(*args)
    assert e.value.param == W
    assert match in e.value.message, e.value.message
    return e.value


def _tiff() -> bytes:
    return _encode(PILImage.new("RGB", (8, 8)), "TIFF")


@pytest.mark.parametrize(
    "data, limits, match",
    [
        (b"\0" * 3000, ImageLimits(max_bytes=2048), "is 2.9 KiB; the limit is 2 KiB per image (--max-image-bytes)"),
        (_png_header(20000, 20000), ImageLimits(), "is 20000x20000 pixels (400 MP); the limit is 16.8 MP"),
        (_png_header(65535, 65535), ImageLimits(), "65535x65535 pixels"),  # past Pillow's own DecompressionBombError
        (_png_header(300, 300), ImageLimits(max_pixels=50_000), "(0.09 MP); the limit is 0.05 MP (--max-image-pixels)"),
        (_gif_with_huge_first_frame(), ImageLimits(), "the limit is 16.8 MP"),
        (IMAGES["wide.png"][: len(IMAGES["wide.png"]) // 2], ImageLimits(), "is a truncated or corrupt PNG"),
        (IMAGES["tall.jpg"][: len(IMAGES["tall.jpg"]) // 2], ImageLimits(), "is a truncated or corrupt JPEG"),
        (IMAGES["square.webp"][:40], ImageLimits(), "is a truncated or corrupt WebP"),
        (IMAGES["wide.png"][:20], ImageLimits(), "is a truncated or corrupt PNG"),
        (b"GIF89a" + b"\xff" * 3, ImageLimits(), "is a truncated or corrupt GIF"),
        (b"just some text, not a picture", ImageLimits(), "is not an image (PNG, JPEG, WebP or GIF)"),
        (b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n1 0 obj\n", ImageLimits(), "is not an image (PNG, JPEG, WebP or GIF)"),
        (_encode(PILImage.new("RGB", (8, 8)), "BMP"), ImageLimits(), "is not an image (PNG, JPEG, WebP or GIF)"),
        (_tiff(), ImageLimits(), "is not an image (PNG, JPEG, WebP or GIF)"),
        (b"", ImageLimits(), "is not an image"),
    ],
    ids=["bytes", "pixels", "pillow-bomb", "pixels-custom", "gif-bomb", "trunc-png", "trunc-jpeg", "trunc-webp",
         "png-header-only", "gif-garbage", "text", "pdf", "bmp", "tiff", "empty"],
)  # fmt: skip
def test_decode_refuses(data, limits, match):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Pillow's DecompressionBombWarning must not escape either
        _raises(decode_image, data, limits, W, match=match)


def _data_uri(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


def test_data_uri_round_trip():
    png = IMAGES["wide.png"]
    assert parse_data_uri(_data_uri(png), ImageLimits(), W) == png
    assert (
        parse_data_uri(_data_uri(png).replace("data:image/png;", "DATA:Image/PNG;"), ImageLimits(), W) == png
    )
    unpadded = _data_uri(png[:100]).rstrip("=")  # some clients drop the padding
    assert parse_data_uri(unpadded, ImageLimits(), W) == png[:100]
    assert (
        parse_data_uri(_data_uri(png, "image/jpeg"), ImageLimits(), W) == png
    )  # the bytes decide the format


@pytest.mark.parametrize(
    "uri, limits, match",
    [
        ("data:image/png;base64,iVBORw0K@@@!!", ImageLimits(), "payload is not valid base64"),
        ("data:image/png;base64,iVBORw0K\u00e9Zg==", ImageLimits(), "payload is not valid base64"),
        ("data:image/png;base64,iVBOR", ImageLimits(), "payload is not valid base64"),
        ("data:image/png,\x89PNG", ImageLimits(), "is a data: URI that is not base64-encoded"),
        ("data:text/plain;base64,aGVsbG8=", ImageLimits(), "of type 'text/plain', not an image"),
        ("data:;base64,aGVsbG8=", ImageLimits(), "of type 'text/plain', not an image"),
        ("data:image/png;base64", ImageLimits(), "without a ','"),
        ("https://example.com/a.png", ImageLimits(), "is not a data: URI"),
        ("data:image/png;base64," + "A" * 4_000_000, ImageLimits(max_bytes=1000), "is about 2.9 MiB; the limit is"),
        (_data_uri(b"\0" * 1500), ImageLimits(max_bytes=1499), "is more than 1.5 KiB; the limit is 1.5 KiB per image"),
    ],
    ids=["bad-chars", "non-ascii", "bad-length", "not-base64", "text", "no-type", "no-comma", "not-data",
         "estimate", "exact"],
)  # fmt: skip
def test_data_uri_refuses(uri, limits, match):
    _raises(parse_data_uri, uri, limits, W, match=match)


def test_image_count():
    check_image_count(8, ImageLimits(), "messages")
    with pytest.raises(
        InvalidRequestError, match=r"has 9 images; the limit is 8 per request \(--max-images\)"
    ):
        check_image_count(9, ImageLimits(), "messages")


# ---- the SSRF guard: refused before any connection -------------------------------------------------------------

_real_getaddrinfo = socket.getaddrinfo


@pytest.fixture
def resolver(monkeypatch) -> dict[str, list[str]]:
    """Names resolve only from the returned table (numeric hosts as usual): never a DNS query."""
    table: dict[str, list[str]] = {"localhost": ["127.0.0.1", "::1"]}

    def fake_getaddrinfo(host, port, family=0, type=0, proto=0, flags=0):
        name = host.decode() if isinstance(host, bytes) else host
        if name in table:
            return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port))
                    for a in table[name]]  # fmt: skip
        return _real_getaddrinfo(host, port, family, type, proto, flags | socket.AI_NUMERICHOST)

    monkeypatch.setattr(socket, "getaddrinfo", fake_getaddrinfo)
    return table


@pytest.fixture
def no_network(resolver, monkeypatch) -> dict[str, list[str]]:
    """`resolver`, and any connection attempt fails the test."""

    async def no_connect(*args, **kwargs):
        raise AssertionError("the guard let a connection through")

    monkeypatch.setattr(httpcore.AnyIOBackend, "connect_tcp", no_connect)
    return resolver


def _fetch_refused(url: str, policy: MediaPolicy, match: str) -> str:
    t0 = time.monotonic()
    with pytest.raises(InvalidRequestError) as e:
        asyncio.run(fetch_image(url, policy, W))
    assert time.monotonic() - t0 < 2
    assert e.value.param == W and e.value.http_status == 400
    assert match in e.value.message, e.value.message
    return e.value.message


@pytest.mark.parametrize(
    "url, match",
    [
        ("file:///etc/passwd", "only http and https image URLs are fetched, not 'file:'"),
        ("ftp://example.com/a.png", "not 'ftp:'"),
        ("http://127.0.0.1/a.png", "is a loopback address (127.0.0.1)"),
        ("http://localhost:8080/a.png", "'localhost' is a loopback address"),
        ("http://[::1]/a.png", "is a loopback address (::1)"),
        ("http://10.0.0.1/a.png", "is a private address (10.0.0.1)"),
        ("http://192.168.1.1/a.png", "is a private address"),
        ("http://169.254.169.254/latest/meta-data/", "is a link-local address (169.254.169.254)"),
        ("http://[::ffff:127.0.0.1]/a.png", "loopback address (::ffff:7f00:1, i.e. 127.0.0.1)"),
        ("http://[::ffff:a9fe:a9fe]/", "link-local address (::ffff:a9fe:a9fe, i.e. 169.254.169.254)"),
        ("http://[64:ff9b::a00:1]/", "private address (64:ff9b::a00:1, i.e. 10.0.0.1)"),  # NAT64
        ("http://[2002:a00:1::1]/", "private address (2002:a00:1::1, i.e. 10.0.0.1)"),  # 6to4
        ("http://[fe80::1]/", "link-local"),
        ("http://[fd00::1]/", "private"),
        ("http://100.64.0.1/", "carrier-grade NAT"),
        ("http://0.0.0.0/", "is an unspecified address"),
        ("http://224.0.0.1/", "multicast"),
        ("http://240.0.0.1/", "reserved"),
        ("http://2130706433/", "loopback address (127.0.0.1)"),  # 127.0.0.1 as one number
        ("http://mixed.test/a.png", "is a private address (10.0.0.5)"),  # one bad address is enough
        ("http://nowhere.test/a.png", "does not resolve"),
        ("not a url at all", "only http and https image URLs are fetched, not a URL without a scheme"),
    ],
)
def test_guard_refuses_without_connecting(no_network, url, match):
    no_network["mixed.test"] = ["8.8.8.8", "10.0.0.5"]
    _fetch_refused(url, MediaPolicy(), match)


def test_guard_allowed_domains(no_network):
    no_network["img.example.com"] = ["10.1.1.1"]  # listed hostnames still need public addresses
    policy = MediaPolicy(allowed_domains=("example.com", "127.0.0.2"))
    _fetch_refused("https://example.com.evil.net/a.png", policy, "'example.com.evil.net' are not allowed")
    _fetch_refused("https://badexample.com/a.png", policy, "--allowed-media-domains allows example.com")
    _fetch_refused("http://10.0.0.1/a.png", policy, "'10.0.0.1' are not allowed")
    _fetch_refused("https://img.example.com/a.png", policy, "is a private address (10.1.1.1)")
    off = MediaPolicy(allow_urls=False)
    _fetch_refused(
        "https://example.com/a.png", off, "image URLs are switched off on this server (--no-image-urls)"
    )
    with pytest.raises(InvalidRequestError, match="--no-image-urls"):
        asyncio.run(load_image("https://example.com/a.png", off, W))
    with pytest.raises(InvalidRequestError, match="must be a data: URI or an http"):
        asyncio.run(load_image("ftp://example.com/a.png", MediaPolicy(), W))


@pytest.mark.parametrize(
    "addr, why",
    [("8.8.8.8", None), ("2606:4700:4700::1111", None), ("::ffff:8.8.8.8", None), ("64:ff9b::808:808", None),
     ("127.8.9.10", "loopback"), ("172.16.0.1", "private"), ("fc00::1", "private"), ("169.254.0.1", "link-local"),
     ("ff02::1", "multicast"), ("::", "unspecified"), ("100.127.255.255", "carrier-grade NAT (100.64.0.0/10)"),
     ("192.0.2.1", "private")],
)  # fmt: skip
def test_address_refusal(addr, why):
    import ipaddress

    assert address_refusal(ipaddress.ip_address(addr)) == why


# ---- fetches from a local server -------------------------------------------------------------------------------

SERVED = IMAGES["tiny.gif"]


class _Handler(BaseHTTPRequestHandler):
    release: threading.Event

    def log_message(self, *args) -> None:
        pass

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for k, v in {"Content-Length": str(len(body)), **(headers or {})}.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        path, _, query = self.path.partition("?")
        try:
            if path == "/img":
                self._send(200, SERVED, {"Content-Type": "image/gif"})
            elif path == "/host":
                self._send(200, self.headers["Host"].encode())
            elif path == "/redirect":
                self._send(302, headers={"Location": query})
            elif path == "/loop":
                self._send(301, headers={"Location": "/loop"})
            elif path == "/stream":  # no Content-Length: HTTP/1.0, the body ends when the connection does
                self.close_connection = True
                self.send_response(200)
                self.end_headers()
                for _ in range(400):
                    self.wfile.write(b"\0" * 65536)
            elif path == "/huge":
                self._send(200, b"\0" * 10, {"Content-Length": str(10**9)})
            elif path == "/hang":
                self.release.wait(10)
            else:
                self._send(404, b"no such image")
        except OSError:
            pass  # the client hung up, as it should after a refusal


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """http://127.0.0.1:<port> of a small HTTP server in a thread."""
    release = threading.Event()
    handler = type("Handler", (_Handler,), {"release": release})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    srv.daemon_threads = True
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    release.set()
    srv.shutdown()
    srv.server_close()


LOCAL = MediaPolicy(allowed_domains=("127.0.0.1",), timeout=2.0)


def test_fetch_allowed_local_server(server):
    assert asyncio.run(fetch_image(f"{server}/img", LOCAL, W)) == SERVED
    assert (
        asyncio.run(fetch_image(f"{server}/redirect?/img", LOCAL, W)) == SERVED
    )  # a relative redirect, vetted too
    image = asyncio.run(load_image(f"{server}/img", LOCAL, W))
    assert image.size == (13, 29) and image.digest == hashlib.sha256(SERVED).digest()
    image = asyncio.run(load_image(_data_uri(SERVED, "image/gif"), MediaPolicy(allow_urls=False), W))
    assert image.size == (13, 29)


@pytest.mark.parametrize(
    "path, policy, match",
    [
        ("/redirect?http://10.0.0.1/img", LOCAL, "images from '10.0.0.1' are not allowed"),
        ("/redirect?http://evil.test/img", LOCAL, "images from 'evil.test' are not allowed"),
        ("/redirect?file:///etc/passwd", LOCAL, "not 'file:'"),
        ("/loop", LOCAL, "redirected more than 3 times"),
        ("/stream", MediaPolicy(allowed_domains=("127.0.0.1",), limits=ImageLimits(max_bytes=100_000)),
         "is more than 97.7 KiB at '127.0.0.1'; the limit is 97.7 KiB per image (--max-image-bytes)"),
        ("/huge", LOCAL, "is 953.7 MiB at '127.0.0.1'; the limit is 20 MiB per image"),
        ("/missing.png", LOCAL, "'127.0.0.1' answered HTTP 404"),
        ("/hang", MediaPolicy(allowed_domains=("127.0.0.1",), timeout=0.3), "from '127.0.0.1' timed out"),
        ("/hang", MediaPolicy(allowed_domains=("127.0.0.1",), total_timeout=0.3), "took longer than 0.3s"),
    ],
    ids=["to-private", "to-other-host", "to-file", "loop", "stream-too-big", "content-length", "404",
         "read-timeout", "total-timeout"],
)  # fmt: skip
def test_fetch_refused_from_local_server(server, monkeypatch, path, policy, match):
    monkeypatch.setattr(socket, "getaddrinfo", None)  # no name lookups: every refused hop stops before DNS
    _fetch_refused(server + path, policy, match)


def test_redirect_hop_gets_the_address_check(server, resolver):
    """A listed hostname is no exception to the address check: a redirect to it from an allowed server is refused."""
    policy = MediaPolicy(allowed_domains=("127.0.0.1", "localhost"), timeout=2.0)
    _fetch_refused(
        f"{server}/redirect?http://localhost/img", policy, "'localhost' is a loopback address (127.0.0.1)"
    )


def test_fetch_connection_refused():
    with socket.socket() as s:  # a port with nobody listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _fetch_refused(
        f"http://127.0.0.1:{port}/img", LOCAL, "fetching the image from '127.0.0.1' failed: ConnectError"
    )


def test_connection_goes_to_the_vetted_address(server, monkeypatch):
    """DNS rebinding: the name is resolved once, vetted, and the socket goes to that address, not a second lookup."""
    port = int(server.rsplit(":", 1)[1])
    answers = iter([["127.0.0.1"]])  # a second lookup would get nothing (StopIteration)
    calls = []

    def rebinding_getaddrinfo(host, p, family=0, type=0, proto=0, flags=0):
        name = host.decode() if isinstance(host, bytes) else host
        if name != "pinned.test":
            return _real_getaddrinfo(host, p, family, type, proto, flags | socket.AI_NUMERICHOST)
        calls.append(name)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, p)) for a in next(answers)]

    monkeypatch.setattr(socket, "getaddrinfo", rebinding_getaddrinfo)
    monkeypatch.setattr(fetch_mod, "address_refusal", lambda addr: None)  # the test server is on loopback
    policy = MediaPolicy(allowed_domains=("pinned.test",), timeout=2.0)
    assert (
        asyncio.run(fetch_image(f"http://pinned.test:{port}/host", policy, W))
        == f"pinned.test:{port}".encode()
    )
    assert calls == ["pinned.test"]


# ---- https: pinning the address keeps the certificate's hostname check -----------------------------------------


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory) -> Iterator[tuple[int, Path]]:
    """(port, CA file) of an https server on 127.0.0.1 whose self-signed certificate is for good.test only."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", d / "key.pem", "-out", d / "cert.pem", "-days", "2", "-subj", "/CN=good.test",
         "-addext", "subjectAltName=DNS:good.test"],
        check=True, capture_output=True,
    )  # fmt: skip
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(d / "cert.pem", d / "key.pem")
    srv = ThreadingHTTPServer(("127.0.0.1", 0), type("Handler", (_Handler,), {"release": threading.Event()}))
    srv.daemon_threads = True
    srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    srv.handle_error = lambda *a: None  # the refused handshake is expected
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_address[1], d / "cert.pem"
    srv.shutdown()
    srv.server_close()


def test_https_pinned_address_still_checks_the_hostname(tls_server, monkeypatch):
    port, ca = tls_server

    def to_loopback(host, p, family=0, type=0, proto=0, flags=0):
        name = host.decode() if isinstance(host, bytes) else host
        name = "127.0.0.1" if name.endswith(".test") else name
        return _real_getaddrinfo(name, p, family, type, proto, flags | socket.AI_NUMERICHOST)

    monkeypatch.setattr(socket, "getaddrinfo", to_loopback)
    monkeypatch.setattr(fetch_mod, "address_refusal", lambda addr: None)
    monkeypatch.setattr(fetch_mod, "_ssl_context", lambda: ssl.create_default_context(cafile=str(ca)))
    policy = MediaPolicy(allowed_domains=("good.test", "evil.test"), timeout=2.0)
    assert asyncio.run(fetch_image(f"https://good.test:{port}/img", policy, W)) == SERVED
    # Same address, same certificate, another name: the TLS check must fail on the hostname.
    message = _fetch_refused(f"https://evil.test:{port}/img", policy, "from 'evil.test' failed: ConnectError")
    assert "Hostname mismatch" in message, message
