"""What a request asks of a thinking model's reasoning, over the server's defaults: on or off, a budget, an effort,
split from the answer or not; and the grammar that applies from the end of the reasoning block."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any, Protocol

from quantserve.chat.reasoning import ReasoningFormat
from quantserve.errors import InvalidRequestError
from quantserve.structured import Grammar, lark_text

EFFORTS = ("low", "medium", "high")


class ReasoningDefaults(Protocol):
    """The server's defaults a request's controls go over (quantserve.core.settings.EngineSettings has them)."""

    reasoning: str
    reasoning_format: str
    reasoning_budget: int | None


@dataclass(frozen=True)
class ReasoningRequest:
    """What a request (over the server's defaults) asks of the reasoning.

    `mode`: on (the block is opened in the prompt if the template does not open it), off, or auto (thinking
    where the model thinks by itself). `budget`: at most this many reasoning tokens (None: unbounded). `effort`: low, medium or high, for templates that read `reasoning_effort` (gpt-oss). `separate`:
    reasoning goes apart from the answer (--reasoning-format auto); False leaves it in the content as written.
    `asked`: the request field that asked for reasoning, named in the error when the model has none.
    """

    mode: str = "auto"
    budget: int | None = None
    effort: str | None = None
    separate: bool = True
    asked: str | None = None

    def variables(self, fmt: ReasoningFormat | None) -> dict[str, Any]:
        """Template variables: the switch (`enable_thinking`, and Granite's `thinking`) and the effort."""
        out: dict[str, Any] = {}
        if fmt is not None:  # on unless asked off, as llama.cpp passes it (templates differ when it is unset)
            out["enable_thinking"] = out["thinking"] = self.mode != "off"
        if self.effort is not None:
            out["reasoning_effort"] = self.effort
        return out

    @classmethod
    def over(
        cls,
        settings: ReasoningDefaults,
        *,
        enable: bool | None = None,
        budget: Any = None,
        effort: Any = None,
        asked: str | None = None,
        budget_param: str = "reasoning_budget",
        effort_param: str = "reasoning_effort",
    ) -> ReasoningRequest:
        """A request's controls over `settings` (--reasoning, --reasoning-format, --reasoning-budget, models.toml).
        `enable`: the request's own switch; `asked`: the field that asked for thinking explicitly (a 400 names it
        if the model has no reasoning).

        Raises:
            InvalidRequestError: a budget that is not an integer of 0 or more, an effort not low/medium/high.
        """
        mode = settings.reasoning if enable is None else ("on" if enable else "off")
        budget = check_budget(budget, budget_param)
        return cls(
            mode=mode,
            budget=budget if budget is not None else settings.reasoning_budget,
            effort=check_effort(effort, effort_param),
            separate=settings.reasoning_format != "none",
            asked=asked,
        )


def check_budget(value: Any, param: str) -> int | None:
    """A reasoning budget from a request: None or a non-negative integer, as --reasoning-budget takes it (0: the
    reasoning block is closed at once).

    Raises:
        InvalidRequestError: anything else, naming `param`.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidRequestError(
            f"'{param}' must be a number of reasoning tokens, 0 or more (0: no thinking); got {value!r}",
            param=param,
        )
    return value


def check_effort(value: Any, param: str) -> str | None:
    if value is None or value in EFFORTS:
        return value
    raise InvalidRequestError(f"'{param}' must be 'low', 'medium' or 'high'; got {value!r}", param=param)


def after_reasoning(grammar: Grammar, fmt: ReasoningFormat, opened: bool, special: dict[str, int]) -> Grammar:
    """`grammar`, applied from the end of the reasoning block (lazily, as llama.cpp's triggered grammars): the
    block is free text up to its end marker, and a reply that does not open one starts with the grammar at
    once. Blank space (and harmony's header of the answer) may come between the block and the grammar."""
    inner = json.loads(grammar.source)["grammars"] if grammar.source.lstrip().startswith("{") else None
    first, rest = (inner[0], inner[1:]) if inner else ({"lark_grammar": grammar.source}, [])
    end = lark_text(fmt.end, special)
    header = f"({lark_text(fmt.answer_header, special)})?" if fmt.answer_header else ""
    block = (
        f"think[lazy]: TEXT {end}"
        if opened
        else f"think: {lark_text(fmt.start, special)} body\nbody[lazy]: TEXT {end}"
    )
    head = "think" if opened else "think?"
    lark = f"start: {head} /[ \\t\\n]*/ {header} @inner\n{block}\nTEXT: /(.|\\n)*/"
    doc = {"grammars": [{"lark_grammar": lark}, {**first, "name": "inner"}, *rest]}
    return replace(grammar, source=json.dumps(doc, ensure_ascii=False))
