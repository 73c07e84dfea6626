"""Chat templates render like transformers does, inside jinja2's immutable sandbox."""

from __future__ import annotations

import pytest

from quantserve.chat.template import ChatTemplate
from quantserve.errors import ChatTemplateError, ConfigError
from quantserve.formats import read_gguf_info

MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def test_smollm2_template_renders_chatml(smollm2_gguf):
    t = ChatTemplate(read_gguf_info(smollm2_gguf).chat_template)
    assert t.render(MSGS) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    # without a system message the template adds SmolLM2's own
    assert t.render(MSGS[1:]).startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_trim_and_lstrip_blocks_and_tojson_like_transformers():
    src = (
        "{% for m in messages %}\n  {% if m %}{{ m.role }}:{{ m.content | tojson }}{% endif %}\n{% endfor %}"
    )
    assert ChatTemplate(src).render([{"role": "user", "content": "é"}] * 2) == 'user:"é"user:"é"'


@pytest.mark.parametrize(
    "src",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__.__init__.__globals__ }}",
        "{% set x = messages.append(1) %}{{ x }}",  # immutable: no mutation of inputs
        "{{ cycler.__init__.__globals__.os }}",
    ],
)
def test_sandbox_blocks_escapes_and_mutation(src):
    with pytest.raises(ChatTemplateError):
        ChatTemplate(src).render(MSGS)


def test_a_template_may_build_its_own_lists():
    """Kimi's templates append to lists they make; the inputs stay immutable (the test above)."""
    src = "{% set xs = [] %}{% for m in messages %}{% set _ = xs.append(m.role) %}{% endfor %}{{ xs | join(',') }}"
    assert ChatTemplate(src).render(MSGS) == ",".join(m["role"] for m in MSGS)


def test_raise_exception_becomes_a_request_error():
    t = ChatTemplate(
        "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
    )
    with pytest.raises(ChatTemplateError, match="first must be user"):
        t.render(MSGS)


def test_syntax_error_is_a_config_error(tmp_path):
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for %}")
    with pytest.raises(ConfigError, match="does not parse"):
        ChatTemplate.from_file(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        ChatTemplate.from_file(tmp_path / "missing.jinja")
