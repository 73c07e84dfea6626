"""LLM: the library API under the server and CLI — load a model, render chats, generate, embed."""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import uuid
from collections.abc import AsyncIterator
from collections.abc import Sequence as Seq
from dataclasses import replace
from functools import cached_property
from typing import Any

from quantserve.chat import ChatPrompt, ChatRequest, ChatTemplate, Reply, TextDelta, build_prompt, tool_format
from quantserve.chat.formats import ToolFormat
from quantserve.chat.reasoning import ReasoningFormat
from quantserve.chat.reasoning_request import ReasoningRequest
from quantserve.chat.tools import parse_openai_tool_choice, parse_openai_tools
from quantserve.core.detokenizer import IncrementalDetokenizer
from quantserve.core.multimodal import Image, ImageSpan, expand_images
from quantserve.core.plan import ModelPlan
from quantserve.core.runner import EngineStats, ModelInfo, ModelRunner, VisionSpec
from quantserve.core.sampling_params import SamplingParams
from quantserve.core.sequence import Sequence
from quantserve.core.settings import EngineSettings
from quantserve.core.thinking import ThinkingSpec
from quantserve.engine.async_engine import AsyncEngine, RequestStream
from quantserve.engine.kv import make_kv
from quantserve.engine.llm_engine import LLMEngine
from quantserve.engine.scheduler import SchedulerConfig
from quantserve.errors import (
    ChatTemplateError,
    ContextLengthExceededError,
    EmbeddingsUnsupportedError,
    InvalidRequestError,
    ModelUnavailableError,
)
from quantserve.registry import ResolvedModel
from quantserve.structured import Grammar, GuideCompiler
from quantserve.submission import Choice, Submission, TextRequest

log = logging.getLogger("quantserve")


class LLM:
    """A loaded model behind an engine thread. Use `LLM.load(...)`, then `generate`/`chat` from asyncio code."""

    def __init__(
        self,
        name: str,
        runner: ModelRunner,
        plan: ModelPlan,
        chat_template: ChatTemplate | None,
        info: ModelInfo,
    ):
        self.name = name
        self._runner = runner
        self.plan = plan  # what was decided before loading (capabilities, template, KV), read by /v1/models
        self.settings = settings = plan.settings
        self.chat_template = chat_template
        self.info = info  # architecture, parameters, format, backend: as loaded
        self._keep_alive: Any = None  # a temporary conversion, kept as long as the model (LLM.load sets it)
        self.n_ctx = runner.n_ctx
        self.n_vocab = runner.n_vocab
        self.vision: VisionSpec | None = runner.vision  # None: text only
        # > 0: a reranker's classification head (llama.cpp's rank pooling), which scores and never generates
        self.rank_outputs: int = plan.rank_outputs
        self.rank_labels: tuple[str, ...] = runner.rank_labels  # the head's, where it names them
        config = SchedulerConfig(
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.n_batch,
            max_queue_len=settings.max_queue_len,
        )
        kv = make_kv(runner.kv_spec, prefix_caching=settings.prefix_cache)
        self._engine = AsyncEngine(LLMEngine(runner, config, kv), max_queue_len=settings.max_queue_len)
        self._embed_lock = asyncio.Lock()
        # The grammar engine's view of the vocabulary takes about 0.1 s per 50k tokens to build: it is built on a
        # thread of its own from the start, so that neither the load nor the first constrained request waits.
        self._guides: GuideCompiler | None = None
        self._guides_error: BaseException | None = None
        self._guides_thread = threading.Thread(
            target=self._build_guides, name="quantserve-vocab", daemon=True
        )
        self._guides_thread.start()

    def _build_guides(self) -> None:
        try:
            self._guides = GuideCompiler(self._runner.vocabulary(), self._runner.n_vocab)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the first request that needs it
            self._guides_error = exc

    @property
    def guides(self) -> GuideCompiler:
        """The model's vocabulary in the grammar engine's form (see __init__)."""
        self._guides_thread.join()
        if self._guides is None:
            raise RuntimeError(f"the grammar engine could not read the vocabulary: {self._guides_error}")
        return self._guides

    @cached_property
    def _format(self) -> ToolFormat:
        return tool_format(self._template())

    @cached_property
    def reasoning_format(self) -> ReasoningFormat | None:
        """How the model's template marks reasoning (None: it has none, or no template)."""
        return None if self.chat_template is None else self.chat_template.reasoning

    def reasoning_request(self, **controls: Any) -> ReasoningRequest:
        """A request's reasoning controls over this model's settings (ReasoningRequest.over's keywords)."""
        return ReasoningRequest.over(self.settings, **controls)

    def thinking_spec(self, prompt: ChatPrompt) -> ThinkingSpec | None:
        """What the engine watches in a reply that may think: the block's markers, and the end marker's tokens
        to write once the budget is spent."""
        fmt = prompt.reasoning
        if fmt is None:
            return None
        forced = self._runner.tokenize(fmt.close_text, add_special=False, parse_special=True)
        return ThinkingSpec(fmt.start.encode(), fmt.end.encode(), prompt.opened, prompt.budget, tuple(forced))

    @staticmethod
    def plan_for(model: ResolvedModel, settings: EngineSettings) -> ModelPlan:
        """How `model` would be run under `settings`: detected once, from headers only, nothing loaded.

        Raises:
            ModelFileError: the files are malformed (validated before any C code sees them).
            BackendUnavailableError: the format needs a backend that is not available here.
            ConfigError: a setting the chosen backend refuses.
        """
        from quantserve.backends.select import plan_model
        from quantserve.formats import detect

        settings = settings.for_model(model.entry)
        if model.mmproj is not None and settings.llamacpp.mmproj is None:  # models.toml's, resolved
            settings = replace(settings, llamacpp=replace(settings.llamacpp, mmproj=str(model.mmproj)))
        return plan_model(detect(model.path), settings)

    @staticmethod
    def check(plan: ModelPlan) -> None:
        """What can refuse the model before any memory is spent on it (a GGUF's probe in a child process).

        Raises:
            ModelFileError: the file would kill or fail the load.
        """
        from quantserve.backends.select import BACKENDS

        BACKENDS[plan.backend].check(plan)

    @classmethod
    def load(cls, model: ResolvedModel, settings: EngineSettings, plan: ModelPlan | None = None) -> LLM:
        """Plan the model (unless `plan` is given, from plan_for), log the plan, and carry it out.

        Raises:
            ModelFileError: the file is malformed or truncated, or llama.cpp's probe refused it.
            BackendUnavailableError: the format needs a backend that is not available here.
        """
        from quantserve.backends.select import BACKENDS

        plan = plan or cls.plan_for(model, settings)
        for key, lines in plan.rows():
            for line in lines:
                log.info("plan for %s: %s: %s", model.name, key, line)
        loaded = BACKENDS[plan.backend].load(plan)
        bos, eos = loaded.bos_token, loaded.eos_token
        template = None
        if (t := plan.template) is not None:
            template = ChatTemplate.shared(t.text, bos, eos, t.origin)  # the plan's, where BOS and EOS agree
        llm = cls(model.name, loaded.runner, plan, template, loaded.info)
        llm._keep_alive = loaded.keep_alive  # a temporary conversion lives as long as the model
        return llm

    # ---- prompts ------------------------------------------------------------------------------

    def _template(self) -> ChatTemplate:
        self._refuse_if_reranker("messages")
        if self.chat_template is None:
            raise ChatTemplateError(
                f"model {self.name!r} has no chat template, so it cannot serve chats; use /v1/completions, or "
                "restart with --chat-template FILE",
                param="messages",
            )
        return self.chat_template

    def render_chat(self, messages: list[dict[str, Any]], **extra: Any) -> str:
        return self._template().render(messages, add_generation_prompt=True, **extra)

    @property
    def takes_images(self) -> bool:
        return self.vision is not None

    @property
    def can_embed(self) -> bool:
        return "embeddings" in self.plan.capabilities

    def _refuse_if_reranker(self, param: str) -> None:
        if self.rank_outputs:
            raise InvalidRequestError(
                f"model {self.name!r} is a reranker (a classification head): it scores documents for a query on "
                "/v1/rerank and does not generate text; serve a chat model for this endpoint",
                param=param,
            )

    @property
    def gpu_share(self) -> float:
        """The share of the model's layers on a GPU (0 on the CPU): llama.cpp's offload, or torch's device."""
        return self._runner.gpu_share

    def prepare_chat(
        self, request: ChatRequest, images: Seq[Image] = ()
    ) -> tuple[ChatPrompt, list[int], list[ImageSpan]]:
        """The prompt of a chat (its tools in the model's own tool-call format), its tokens, and where its images
        sit among them; the prompt also carries the grammar for the reply and makes the parser that reads tool
        calls out of it. `images` are the request's, in the order of the `{"type": "image"}` parts of its messages.

        Raises:
            ChatTemplateError: the model has no template, or it rejects these messages.
            InvalidRequestError: a response schema or tool schema the grammar engine cannot take; images the
                template did not place.
        """
        thinking = self.reasoning_format
        special = self.guides.special if request.calls_tools or thinking is not None else {}
        fmt = self._format if request.needs_format or self._format.frames else None
        prompt = build_prompt(self._template(), fmt, request, special, thinking)
        tokens = self.tokenize_prompt(prompt.text, chat=True)
        if self.vision is None:
            return prompt, tokens, []
        marks = tokens.count(self.vision.image_token)
        if marks != len(images):
            mark = self._runner.token_bytes(self.vision.image_token, special=True).decode("utf-8", "replace")
            raise InvalidRequestError(
                f"the prompt holds {marks} image markers ({mark!r}) for {len(images)} images"
                + (
                    f"; remove {mark!r} from the text, where it stands for an image"
                    if marks > len(images)
                    else "; the model's chat template did not place every image (send images in user messages)"
                ),
                param="messages",
            )
        tokens, spans = expand_images(
            tokens, self.vision.image_token, list(images), self.vision.tokens_per_image
        )
        return prompt, tokens, spans

    @property
    def tool_format(self) -> str | None:
        """The name of the tool-call format the model's template uses (None without a template)."""
        return self.plan.tool_format

    def tokenize_prompt(self, text: str, *, chat: bool) -> list[int]:
        add_special = self._runner.adds_bos()
        if chat and self.chat_template and self.chat_template.bos_token:
            # Templates that write the BOS themselves must not get a second one from the tokenizer.
            add_special = add_special and not text.startswith(self.chat_template.bos_token)
        return self._runner.tokenize(text, add_special=add_special, parse_special=True)

    def tokenize_text(self, text: str) -> list[int]:
        """`text`'s tokens as they would appear inside a prompt: no BOS, special-token text read as text."""
        return self._runner.tokenize(text, add_special=False, parse_special=False)

    def check_tokens(self, tokens: Seq[int], param: str = "prompt") -> None:
        """Token ids a request sends itself (completions' `prompt`, embeddings' `input`, Ollama's `context`) must
        be in the vocabulary: outside it llama.cpp fails the whole batch's decode, and torch's embedding lookup
        raises (on CUDA, a device-side assert that ends the process). Raises InvalidRequestError naming the id."""
        if tokens and (min(tokens) < 0 or max(tokens) >= self.n_vocab):
            bad = next(t for t in tokens if not 0 <= t < self.n_vocab)
            raise InvalidRequestError(
                f"'{param}' has token id {bad}, outside this model's vocabulary of {self.n_vocab} tokens "
                f"(ids 0 to {self.n_vocab - 1})",
                param=param,
            )

    def check_context(self, n_prompt: int, max_tokens: int | None) -> int:
        """Returns the max_tokens to use. Raises ContextLengthExceededError like OpenAI/vLLM do."""
        if n_prompt == 0:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if n_prompt >= self.n_ctx:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {self.n_ctx} tokens. However, your prompt has "
                f"{n_prompt} tokens. Shorten the prompt, or restart the server with a larger --ctx-size.",
                param="messages",
            )
        if max_tokens is not None and n_prompt + max_tokens > self.n_ctx:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {self.n_ctx} tokens. However, you requested "
                f"{n_prompt + max_tokens} tokens ({n_prompt} in the prompt, {max_tokens} for the completion). "
                "Reduce the prompt or max_tokens.",
                param="max_tokens",
            )
        return max_tokens if max_tokens is not None else self.n_ctx - n_prompt

    def sampling_params(self, **fields: Any) -> SamplingParams:
        """Request fields (None = not given) over the model's defaults over SamplingParams' own."""
        merged = {
            k: v
            for k, v in self.settings.sampling_defaults.items()
            if k in SamplingParams.__dataclass_fields__
        }
        merged.update({k: v for k, v in fields.items() if v is not None})
        if merged.get("seed") is None and self.settings.seed is not None:
            merged["seed"] = self.settings.seed
        return SamplingParams(**merged)

    # ---- generation ---------------------------------------------------------------------------

    def generate(
        self,
        prompt_tokens: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        images: list[ImageSpan] | None = None,
    ) -> RequestStream:
        """Stream the continuation of `prompt_tokens`; `images` as prepare_chat placed them."""
        self._refuse_if_reranker("prompt")
        self.check_tokens(prompt_tokens)  # the routes check under their field's name; this guards the library
        if fault := self.fault():  # a tensor-parallel rank is gone
            raise ModelUnavailableError(f"the model is unavailable: {fault}; restart the server")
        seq = Sequence(
            request_id=request_id or uuid.uuid4().hex,
            prompt_tokens=prompt_tokens,
            params=params,
            detokenizer=IncrementalDetokenizer(params.stop),
            max_total_tokens=self.n_ctx,
            images=list(images or ()),
        )
        self._runner.check_params(params)
        if params.grammar is not None:
            seq.guide = self.guides.guide(params.grammar)  # a grammar llguidance rejects is a 400 here
        return self._engine.generate(seq)

    def submit(self, request: TextRequest) -> Submission:
        """Start `request` on the engine: the one pipeline of the library and every API. A chat's prompt (its tools
        in the model's format, its grammar, its reasoning controls), the prompts' tokens, the context check, the
        sampling over the model's defaults, the thinking budget, n choices per prompt (seeds seed + i, so that
        choices differ) and, for a chat, a reply parser per choice.

        Raises:
            InvalidRequestError: a field of the request (ChatTemplateError, ContextLengthExceededError among
                them), named in `param`.
            QueueFullError: the engine's queue has no room (the choices already queued are aborted).
        """
        chat, spans = None, []
        if request.chat is not None:
            chat, tokens, spans = self.prepare_chat(request.chat, request.images)
            prompts = [tokens]
        else:
            if not request.prompts:
                raise InvalidRequestError("'prompt' is empty", param="prompt")
            prompts = [self._prompt_tokens(p) for p in request.prompts]
        if request.context:
            self.check_tokens(request.context, "context")
            prompts = [[*request.context, *p] for p in prompts]
        max_tokens = min(self.check_context(len(p), request.max_tokens) for p in prompts)
        params = self.sampling_params(
            **request.sampling,
            max_tokens=max_tokens,
            grammar=chat.grammar if chat is not None else request.grammar,
            skip_special_tokens=chat.skip_special_tokens if chat is not None else None,
        )
        if chat is not None and chat.reasoning is not None:
            params = replace(params, thinking=self.thinking_spec(chat), skip_special_tokens=False)
        rid = request.request_id or uuid.uuid4().hex
        gens: list[RequestStream] = []
        choices: list[Choice] = []
        try:
            for p, tokens in enumerate(prompts):
                for j in range(request.n):
                    seeded = (
                        params
                        if request.n == 1 or params.seed is None
                        else replace(params, seed=params.seed + j)
                    )
                    gens.append(self.generate(tokens, seeded, f"{rid}-{p}-{j}", spans))
                    assembler = chat.assembler() if chat is not None else None
                    choices.append(
                        Choice(len(choices), p, num_prompt_tokens=len(tokens), assembler=assembler)
                    )
        except BaseException:
            for g in gens:
                g.close()  # a later choice was refused (queue full): abort the ones already queued
            raise
        return Submission(prompts, chat, gens, choices)

    def _prompt_tokens(self, prompt: str | Seq[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenize_prompt(prompt, chat=False)
        self.check_tokens(prompt, "prompt")
        return list(prompt)

    def chat_request(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: Any = None,
        parallel_tool_calls: bool = True,
        response_schema: dict[str, Any] | None = None,
        grammar: Grammar | None = None,
        thinking: bool | None = None,
        reasoning_budget: int | None = None,
        reasoning_effort: str | None = None,
    ) -> ChatRequest:
        """A chat as the library states it: OpenAI-style messages and tools, and the reasoning controls of
        /v1/chat/completions (`thinking`: its chat_template_kwargs.enable_thinking) over the model's settings."""
        parsed = parse_openai_tools(tools)
        asked = "reasoning_budget" if reasoning_budget is not None else ("thinking" if thinking else None)
        return ChatRequest(
            messages=messages,
            tools=parsed,
            tool_choice=parse_openai_tool_choice(tool_choice, parsed),
            parallel_tool_calls=parallel_tool_calls,
            response_schema=response_schema,
            grammar=grammar,
            reasoning=self.reasoning_request(
                enable=thinking, budget=reasoning_budget, effort=reasoning_effort, asked=asked
            ),
        )

    async def chat(
        self, messages: list[dict[str, Any]], *, max_tokens: int | None = None, **options: Any
    ) -> AsyncIterator[str]:
        """Stream the answer to OpenAI-style messages (its reasoning and tool calls are not in it: `reply` has
        them). `options`: chat_request's keywords (tools, grammar, thinking, reasoning_budget, …) and
        SamplingParams' fields (temperature, seed, stop, …)."""
        async for _, _, events in self._submit_chat(messages, max_tokens, options).outputs():
            for e in events:
                if isinstance(e, TextDelta) and e.text:
                    yield e.text

    async def reply(
        self, messages: list[dict[str, Any]], *, max_tokens: int | None = None, **options: Any
    ) -> Reply:
        """The whole reply to a chat, as the server's /v1/chat/completions gives it: answer, reasoning, tool
        calls and finish reason. Takes chat's keywords."""
        (choice,) = await self._submit_chat(messages, max_tokens, options).finish()
        assert choice.reply is not None
        return choice.reply

    async def complete(
        self,
        prompt: str | list[int],
        *,
        max_tokens: int | None = None,
        grammar: Grammar | None = None,
        **sampling: Any,
    ) -> AsyncIterator[str]:
        """Stream the continuation of a prompt (text, or token ids), as /v1/completions does."""
        request = TextRequest(prompts=[prompt], max_tokens=max_tokens, grammar=grammar, sampling=sampling)
        async for _, out, _ in self.submit(request).outputs():
            if out.text:
                yield out.text

    def _submit_chat(
        self, messages: list[dict[str, Any]], max_tokens: int | None, options: dict[str, Any]
    ) -> Submission:
        chat_keys = set(inspect.signature(self.chat_request).parameters) - {"messages"}
        chat = self.chat_request(messages, **{k: v for k, v in options.items() if k in chat_keys})
        sampling = {k: v for k, v in options.items() if k not in chat_keys}
        return self.submit(TextRequest(chat=chat, max_tokens=max_tokens, sampling=sampling))

    def detokenize(self, tokens: list[int]) -> str:
        return b"".join(self._runner.token_bytes(t) for t in tokens).decode("utf-8", "replace")

    def token_text(self, token: int) -> str:
        return self._runner.token_bytes(token).decode("utf-8", "replace")

    def token_bytes(self, token: int) -> bytes:
        return self._runner.token_bytes(token)

    def stats(self) -> EngineStats:
        """The engine's queue and KV occupancy now, for /metrics."""
        e = self._engine
        ranks = self._runner.rank_step_seconds()
        return EngineStats(
            e.num_waiting, e.num_running, e.kv_cells_used, e.kv_cells_cached, e.steps, tuple(ranks)
        )

    def fault(self) -> str | None:
        """Why the model cannot run any more (a tensor-parallel rank is gone), or None."""
        return self._runner.fault()

    async def embed(self, tokens: list[int]) -> list[float]:
        if not self.can_embed:
            raise EmbeddingsUnsupportedError(f"model {self.name!r} cannot produce embeddings", param="input")
        self.check_tokens(tokens, "input")
        if len(tokens) > self.n_ctx:
            raise ContextLengthExceededError(
                f"input has {len(tokens)} tokens; the maximum is {self.n_ctx}", param="input"
            )
        async with self._embed_lock:
            return await asyncio.to_thread(self._runner.embed, tokens)

    async def rank(self, query: str, documents: list[str]) -> tuple[list[list[float]], int]:
        """A reranker's head outputs for each (query, document) pair, and the tokens they took.

        Raises:
            InvalidRequestError: the model has no classification head, or a pair is over the context.
        """
        if not self.rank_outputs:
            raise InvalidRequestError(f"model {self.name!r} has no classification head", param="model")
        inputs = await asyncio.to_thread(self._runner.pair_inputs, query, documents)
        for i, tokens in enumerate(inputs):
            if len(tokens) > self.n_ctx:
                raise ContextLengthExceededError(
                    f"documents[{i}] with the query makes {len(tokens)} tokens, over the {self.n_ctx} this model "
                    "reads; shorten it (a reranker's limit is its trained positions, or a smaller --ctx-size)",
                    param=f"documents[{i}]",
                )
        async with self._embed_lock:  # the engine never runs on a reranker: its context is this call's alone
            outputs = await asyncio.to_thread(self._runner.rank, inputs)
        return outputs, sum(map(len, inputs))

    def close(self) -> None:
        self._guides_thread.join()  # it reads the runner's vocabulary
        self._engine.stop()
        self._runner.close()
        if self._keep_alive is not None:
            self._keep_alive.cleanup()


def load(model: str | None = None, *, models_file: str | None = None, **settings: Any) -> LLM:
    """Load MODEL (a models.toml name, a path or a hub id; default: models.toml's default) for use from Python.

    `settings` are EngineSettings fields or a backend section's, e.g. `load("smollm2", threads=4, ctx_size=2048,
    flash_attn="on")`."""
    from quantserve.registry import find_models_toml, load_registry, resolve

    resolved = resolve(model, load_registry(find_models_toml(models_file)))
    return LLM.load(resolved, EngineSettings.from_options(**settings))
