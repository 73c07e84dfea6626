"""Constrained decoding: grammars (JSON schemas, Lark) compiled by llguidance, and per-sequence token masks that
both backends apply in their own sampling step."""

from quantserve.structured.grammars import (
    Grammar,
    check,
    embeddable,
    json_rule,
    json_schema_grammar,
    lark_grammar,
    lark_literal,
    lark_text,
    user_grammar,
)
from quantserve.structured.guide import Guide, GuideCompiler, Vocabulary, apply_mask, fill_masks

__all__ = [
    "Grammar",
    "Guide",
    "GuideCompiler",
    "Vocabulary",
    "apply_mask",
    "check",
    "embeddable",
    "fill_masks",
    "json_rule",
    "json_schema_grammar",
    "lark_grammar",
    "lark_literal",
    "lark_text",
    "user_grammar",
]
