"""Images through a real `quantserve run` process (torch backend, the tiny LLaVA): the official openai and anthropic
clients with data URIs, streamed and not; two images behind the same text answer differently (no prefix-cache reuse
across images); the same image gives the same answer; bad images get 400s that name the problem, in each API's
error shape, and leave the server's memory flat."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest

from tests.conftest import start_server
from tests.fixtures.vision import build_tiny_llava, sample_images

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


@pytest.fixture(scope="module")
def tiny_llava(smollm2_hf, tmp_path_factory):
    """The tiny LLaVA in HF form (torch) and as a text GGUF with its mmproj beside it (llama.cpp)."""
    from click.testing import CliRunner

    from quantserve.cli import main

    tmp = tmp_path_factory.mktemp("vision-models")
    hf = build_tiny_llava(tmp / "tiny-llava", smollm2_hf)
    result = CliRunner().invoke(
        main, ["convert", "--src", str(hf), "--dst", f"{tmp}/gguf/", "--quant", "f16"]
    )
    assert result.exit_code == 0, result.output
    return {"torch": hf, "llamacpp": next(p for p in (tmp / "gguf").glob("*.gguf") if "mmproj" not in p.name)}


@pytest.fixture(scope="module", params=["torch", "llamacpp"])
def vision_server(request, tiny_llava, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"vision-server-{request.param}")
    srv = start_server(
        tmp, str(tiny_llava[request.param]), "--backend", request.param, "--ctx-size", "2048",
        "--max-images", "2", "--max-image-bytes", "300000", "--max-num-seqs", "4",
    )  # fmt: skip
    srv.model = httpx.get(srv.base_url + "/v1/models").json()["data"][0][
        "id"
    ]  # the file's or directory's name
    yield srv
    srv.stop()


def ask(client, model: str, uri: str, stream: bool = False, text: str = "What is in the picture?") -> str:
    messages = [{"role": "user", "content": [
        {"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": uri, "detail": "low"}},
    ]}]  # fmt: skip
    kw = {"model": model, "messages": messages, "max_tokens": 12, "temperature": 0}
    if not stream:
        return client.chat.completions.create(**kw).choices[0].message.content
    chunks = client.chat.completions.create(**kw, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_openai_client_chat_with_an_image(vision_server):
    client = openai.OpenAI(base_url=vision_server.base_url + "/v1", api_key="x")
    imgs = sample_images()
    wide, other = data_uri(imgs["wide.png"]), data_uri(imgs["tall.jpg"], "image/jpeg")
    model = vision_server.model
    first = ask(client, model, wide)
    # streamed = not streamed (the second request reads the first's cached prefix)
    assert first and ask(client, model, wide, stream=True) == first
    assert ask(client, model, other) != first  # another image behind the same text: not the first image's KV
    assert ask(client, model, wide) == first
    models = client.models.list().data
    assert models[0].model_extra["meta"]["input_modalities"] == ["text", "image"]


def test_usage_counts_image_tokens(vision_server):
    client = openai.OpenAI(base_url=vision_server.base_url + "/v1", api_key="x")
    messages = [{"role": "user", "content": "What is in the picture?"}]
    text_only = client.chat.completions.create(
        model=vision_server.model, messages=messages, max_tokens=1
    ).usage.prompt_tokens
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_uri(sample_images()["tiny.gif"], "image/gif")}},
        {"type": "text", "text": "What is in the picture?"},
    ]}]  # fmt: skip
    with_image = client.chat.completions.create(
        model=vision_server.model, messages=messages, max_tokens=1
    ).usage.prompt_tokens
    assert with_image - text_only >= 576  # the image's tokens, plus its marker's newline


def test_anthropic_client_and_responses_take_images(vision_server):
    png = sample_images()["wide.png"]
    client = anthropic.Anthropic(base_url=vision_server.base_url, api_key="x")
    msg = client.messages.create(
        model=vision_server.model, max_tokens=8,
        messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(png).decode()}},
            {"type": "text", "text": "What is in the picture?"},
        ]}],
    )  # fmt: skip
    assert msg.content[0].text and msg.usage.input_tokens > 576
    oa = openai.OpenAI(base_url=vision_server.base_url + "/v1", api_key="x")
    resp = oa.responses.create(
        model=vision_server.model, max_output_tokens=8, temperature=0,
        input=[{"role": "user", "content": [
            {"type": "input_text", "text": "What is in the picture?"},
            {"type": "input_image", "image_url": data_uri(png), "detail": "auto"},
        ]}],
    )  # fmt: skip
    assert resp.output_text and resp.usage.input_tokens > 576
    follow = oa.responses.create(
        model=vision_server.model, max_output_tokens=4, previous_response_id=resp.id, input="And the colours?"
    )  # the first turn's image is still in the conversation
    assert follow.usage.input_tokens > resp.usage.input_tokens + 8


def _png_header_claiming(width: int, height: int) -> bytes:
    """A PNG of a few dozen bytes whose header claims width x height (a decompression bomb's shape)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = chunk(b"IDAT", zlib.compress(b"\0" * 64))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + idat + chunk(b"IEND", b"")


BAD = {
    "oversized": (data_uri(sample_images()["big.png"]), "limit"),
    "truncated": (data_uri(sample_images()["wide.png"][:400]), "truncated"),
    "not an image": (data_uri(b"%PDF-1.4 not an image at all", "image/png"), "not an image"),
    "bomb": (data_uri(_png_header_claiming(60000, 60000)), "pixels"),
    "bad base64": ("data:image/png;base64,@@@not-base64@@@", "base64"),
    "loopback URL": ("http://127.0.0.1:1/cat.png", "public hosts"),
    "metadata URL": ("http://169.254.169.254/latest/meta-data", "public hosts"),
    "file URL": ("file:///etc/passwd", "http"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_images_are_400s_naming_the_problem(vision_server, case):
    uri, needle = BAD[case]
    body = {"model": vision_server.model, "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": uri}},
    ]}]}  # fmt: skip
    r = httpx.post(vision_server.base_url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"].lower() and err["param"] == "messages[0].content[1]"


def test_too_many_images_and_anthropic_error_shape(vision_server):
    uri = data_uri(sample_images()["tiny.gif"], "image/gif")
    part = {"type": "image_url", "image_url": {"url": uri}}
    body = {"model": vision_server.model, "messages": [{"role": "user", "content": [part, part, part]}]}
    r = httpx.post(vision_server.base_url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and "limit is 2" in r.json()["error"]["message"]
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "@@"}}
    body = {"model": vision_server.model, "max_tokens": 2, "messages": [{"role": "user", "content": [block]}]}
    r = httpx.post(vision_server.base_url + "/v1/messages", json=body, timeout=30)
    assert r.status_code == 400
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"


def test_text_marker_without_an_image_is_a_400(vision_server):
    body = {
        "model": vision_server.model,
        "messages": [{"role": "user", "content": "look: <image> what is it?"}],
    }
    r = httpx.post(vision_server.base_url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and "<image>" in r.json()["error"]["message"]


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_memory_flat_over_200_bad_requests(vision_server):
    cases = list(BAD.values())
    url = vision_server.base_url + "/v1/chat/completions"

    def burst(n: int) -> None:
        with httpx.Client(timeout=30) as c:
            for i in range(n):
                uri = cases[i % len(cases)][0]
                body = {"model": vision_server.model, "messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": uri}}]}]}  # fmt: skip
                assert c.post(url, json=body).status_code == 400

    burst(40)  # warm: allocator pools and caches settle
    before = _rss_kib(vision_server.proc.pid)
    burst(200)
    after = _rss_kib(vision_server.proc.pid)
    assert after - before < 30 * 1024, f"RSS grew {after - before} KiB over 200 bad requests"
    assert httpx.get(vision_server.base_url + "/healthz").status_code == 200
    assert httpx.get(vision_server.base_url + "/readyz").status_code == 200


def test_text_only_model_refuses_images(server):
    img = np.zeros((4, 4, 3), dtype=np.uint8)
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    body = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_uri(buf.getvalue())}}]}]}  # fmt: skip
    r = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and "takes text only" in r.json()["error"]["message"]


def test_image_url_from_an_allowed_host_and_urls_switched_off(tiny_llava, tmp_path):
    """A URL is fetched from a host the operator allowed (a local server here, private, so named explicitly);
    --no-image-urls refuses URLs and still takes data: URIs."""
    from tests.fixtures.static_server import StaticServer

    png = sample_images()["tall.jpg"]
    httpd = StaticServer(png, "image/jpeg")
    url = f"{httpd.origin}/cat.jpg"
    model = str(tiny_llava["torch"])
    try:
        for flags, expect in ((("--allowed-media-domains", "127.0.0.1"), 200), (("--no-image-urls",), 400)):
            srv = start_server(tmp_path, model, "--backend", "torch", "--ctx-size", "2048", *flags)
            try:
                content = [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": "What?"},
                ]
                body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2}
                r = httpx.post(srv.base_url + "/v1/chat/completions", json=body, timeout=60)
                assert r.status_code == expect, r.text
                if expect == 400:
                    assert "--no-image-urls" in r.json()["error"]["message"]
                    content[0]["image_url"]["url"] = data_uri(png, "image/jpeg")
                    r = httpx.post(srv.base_url + "/v1/chat/completions", json=body, timeout=60)
                    assert r.status_code == 200, r.text
                else:
                    assert r.json()["usage"]["prompt_tokens"] > 576
            finally:
                srv.stop()
    finally:
        httpd.close()


def test_ollama_client_chat_with_images(vision_server):
    """Ollama's `images` (base64, any format) read as the OpenAI route's image parts: the same answer as the same
    chat through /v1/chat/completions (Ollama puts a message's images before its text); bytes that are no image
    get Ollama's error shape."""
    import ollama

    client = openai.OpenAI(base_url=vision_server.base_url + "/v1", api_key="x")
    olla = ollama.Client(host=vision_server.base_url, timeout=300)
    text = "What is in the picture?"
    for name, mime in (("wide.png", "image/png"), ("tall.jpg", "image/jpeg")):
        image = sample_images()[name]
        got = olla.chat(
            model=vision_server.model,
            messages=[{"role": "user", "content": text, "images": [image]}],
            options={"temperature": 0, "num_predict": 12},
        )
        parts = [
            {"type": "image_url", "image_url": {"url": data_uri(image, mime)}},
            {"type": "text", "text": text},
        ]
        want = client.chat.completions.create(
            model=vision_server.model,
            messages=[{"role": "user", "content": parts}],
            max_tokens=12,
            temperature=0,
        )
        assert got.message.content == want.choices[0].message.content
        assert (
            got.eval_count == want.usage.completion_tokens
            and got.prompt_eval_count == want.usage.prompt_tokens
        )
    assert "vision" in olla.show(vision_server.model).capabilities
    bad = {"role": "user", "content": text, "images": [base64.b64encode(b"not an image at all").decode()]}
    r = httpx.post(
        vision_server.base_url + "/api/chat", json={"model": vision_server.model, "messages": [bad]}
    )
    assert r.status_code == 400 and list(r.json()) == ["error"] and "images[0]" in r.json()["error"], r.text
