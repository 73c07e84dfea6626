"""Families that write each argument as a tagged value rather than JSON:

| family | a call looks like |
|---|---|
| Qwen3-Coder, Qwen3.5, Nemotron 3, StepFun | `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>` |
| Seed-OSS | the same inside `<seed:tool_call>…</seed:tool_call>` |
| MiniMax M2 | `<minimax:tool_call>\\n<invoke name="NAME">\\n<parameter name="KEY">VALUE</parameter>\\n</invoke>…` |
| GLM 4.5-4.7, Ling, Laguna, Spark | `<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>\\n</tool_call>` |
| DeepSeek V3.2 / V4 (DSML) | `<｜DSML｜invoke name="NAME">\\n<｜DSML｜parameter name="KEY" string="true">VALUE</…>` |
| Hunyuan 3 | `<tool_call:opensource>NAME<tool_sep:opensource>\\n<arg_key:opensource>KEY</…><arg_value:opensource>…` |
| MiniCPM 5 | `<function name="NAME"><param name="KEY">VALUE</param></function>` |
| Kimi K3 | `<|open|>tools<|sep|><|open|>call tool="NAME" index="1"<|sep|><|open|>argument key="KEY" type="string"<|sep|>…` |

Kimi K3 also wraps its answer in `<|open|>response<|sep|>…<|close|>response<|sep|>` and ends with
`<|close|>message<|sep|>`: those markers are dropped from the answer's text.

How a value is read, and the parser and grammar all of them share, are in chat.formats.tagged.
"""

from __future__ import annotations

from dataclasses import replace

from quantserve.chat.formats.tagged import Tagged, tags_of


class Qwen3Coder(Tagged):
    name = "qwen3-coder"
    priority = 50
    tags = tags_of(
        ("<tool_call>", "</tool_call>"),
        "<function=",
        r"<function=(?P<name>[^>\n]+)>",
        "</function>",
        r"<parameter=(?P<key>[^>\n]+)>",
        "</parameter>",
        "<function={name}>",
        "<parameter={key}>",
        newlines=True,
    )


class SeedOss(Tagged):
    name = "seed-oss"
    priority = 51
    tags = tags_of(
        ("<seed:tool_call>", "</seed:tool_call>"),
        "<function=",
        r"<function=(?P<name>[^>\n]+)>",
        "</function>",
        r"<parameter=(?P<key>[^>\n]+)>",
        "</parameter>",
        "<function={name}>",
        "<parameter={key}>",
    )


class MiniMaxM2(Tagged):
    name = "minimax-m2"
    priority = 52
    tags = tags_of(
        ("<minimax:tool_call>", "</minimax:tool_call>"),
        "<invoke name=",
        r'<invoke name="(?P<name>[^"]+)">',
        "</invoke>",
        r'<parameter name="(?P<key>[^"]+)">',
        "</parameter>",
        '<invoke name="{name}">',
        '<parameter name="{key}">',
    )


class Glm(Tagged):
    name = "glm"
    priority = 53
    tags = tags_of(
        None,
        "<tool_call>",
        r"<tool_call>\s*(?P<name>[^<\s]+)\s*(?=<arg_key>|</tool_call>)",
        "</tool_call>",
        r"<arg_key>(?P<key>[^<]+)</arg_key>\s*<arg_value>",
        "</arg_value>",
        "<tool_call>{name}",
        "<arg_key>{key}</arg_key><arg_value>",
    )


class DsmlV32(Tagged):
    name = "deepseek-v3.2"
    priority = 54
    tags = tags_of(
        ("<｜DSML｜function_calls>", "</｜DSML｜function_calls>"),
        "<｜DSML｜invoke name=",
        r'<｜DSML｜invoke name="(?P<name>[^"]+)">',
        "</｜DSML｜invoke>",
        r'<｜DSML｜parameter name="(?P<key>[^"]+)"(?: string="(?P<string>true|false)")?>',
        "</｜DSML｜parameter>",
        '<｜DSML｜invoke name="{name}">',
        '<｜DSML｜parameter name="{key}" string="{string}">',
    )


class DsmlV4(Tagged):
    name = "deepseek-v4"
    priority = 55
    tags = replace(DsmlV32.tags, section=("<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>"))


class Hunyuan(Tagged):
    name = "hunyuan"
    priority = 56
    tags = tags_of(
        ("<tool_calls:opensource>", "</tool_calls:opensource>"),
        "<tool_call:opensource>",
        r"<tool_call:opensource>(?P<name>[^<]+)<tool_sep:opensource>",
        "</tool_call:opensource>",
        r"<arg_key:opensource>(?P<key>[^<]+)</arg_key:opensource>\s*<arg_value:opensource>",
        "</arg_value:opensource>",
        "<tool_call:opensource>{name}<tool_sep:opensource>",
        "<arg_key:opensource>{key}</arg_key:opensource>\n<arg_value:opensource>",
    )


class MiniCpm(Tagged):
    name = "minicpm"
    priority = 57
    tags = tags_of(
        None,
        "<function name=",
        r'<function name="(?P<name>[^"]+)">',
        "</function>",
        r'<param name="(?P<key>[^"]+)">',
        "</param>",
        '<function name="{name}">',
        '<param name="{key}">',
        pad="",
    )


class KimiK3(Tagged):
    name = "kimi-k3"
    priority = 58
    frames = True
    tags = tags_of(
        ("<|open|>tools<|sep|>", "<|close|>tools<|sep|>"),
        "<|open|>call tool=",
        r'<\|open\|>call tool="(?P<name>[^"]+)"(?: index="\d+")?<\|sep\|>',
        "<|close|>call<|sep|>",
        r'<\|open\|>argument key="(?P<key>[^"]+)"(?: type="(?P<string>\w+)")?<\|sep\|>',
        "<|close|>argument<|sep|>",
        '<|open|>call tool="{name}" index="{n}"<|sep|>',
        '<|open|>argument key="{key}" type="{type}"<|sep|>',
        pad="",
        dropped=("<|open|>response<|sep|>", "<|close|>response<|sep|>", "<|close|>message<|sep|>"),
    )
