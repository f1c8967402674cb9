"""OpenAI wire types (requests and responses) as msgspec Structs, and their validation."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from mlxd.protocol.curve import Curve, Hlg
from mlxd.protocol.errors import APIError

# Every number a request carries has a range, checked while decoding (a 400 naming the field),
# so nothing out of range reaches MLX: OpenAI's documented ranges where it has them, else the
# largest value that means something (token counts and top_k fit an int32; seed an int64).
# JSON has no NaN or infinity, and a float too big for a double (1e999) is out of range too.
MAX_STOPS = 16
MAX_STOP_CHARS = 512  # stop matching holds back and rescans up to this much text per token
MAX_LOGIT_BIAS = 1024  # entries
MAX_TOKEN_ID_DIGITS = 10
INT32_MAX = 2**31 - 1

Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
Probability = Annotated[float, Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
# Divides the positive logits of seen tokens: far below 1 they overflow float16 (65504) to inf.
RepetitionPenalty = Annotated[float, Meta(ge=0.01, le=10.0)]
Bias = Annotated[float, Meta(ge=-100.0, le=100.0)]
TokenCount = Annotated[int, Meta(ge=1, le=INT32_MAX)]
TopK = Annotated[int, Meta(ge=0, le=INT32_MAX)]
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
NumChoices = Annotated[int, Meta(ge=1, le=128)]
AdapterSpec = Annotated[str, Meta(max_length=1024)]
Priority = Annotated[int, Meta(ge=-INT32_MAX - 1, le=INT32_MAX)]  # lower runs sooner (vLLM's field)
Stop = Annotated[str, Meta(max_length=MAX_STOP_CHARS)]
PenaltyContext = Annotated[int, Meta(ge=1, le=2**20)]  # tokens a penalty looks back over
XtcThreshold = Annotated[float, Meta(ge=0.0, le=0.5)]  # mlx-lm's range: above 0.5 two tokens cannot both exceed it


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class ChatMessage(msgspec.Struct, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


MAX_RESUME_TOKENS = 1 << 20
TokenId = Annotated[int, Meta(ge=0, le=INT32_MAX)]


class ChoiceResume(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One choice of an `n` > 1 reply being continued: its token ids so far, how they were split
    into the writes that carried them, and whether its end (finish_reason) was delivered."""

    tokens: Annotated[list[TokenId], Meta(max_length=MAX_RESUME_TOKENS)] = []
    segments: Annotated[list[Annotated[int, Meta(ge=0)]], Meta(max_length=MAX_RESUME_TOKENS)] | None = None
    ended: bool = False


class Resume(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """mlxd's `resume`: go on with a reply whose start was already delivered (docs/resume.md).

    The supervisor sends it when an engine died mid-reply; a client may too. `tokens` are the
    reply's token ids so far (exact: the rest is what the uninterrupted reply would have been);
    else `text`, the reply so far as text (tokenized, so close but not token-exact). `segments`:
    how many of `tokens` each delivered piece carried (the engine's stream marks), so the
    reply's parsers see the text split as it was sent. `id` and `created` are the reply's.
    `resend`: a stream sends the delivered part again first (opening chunk, then the chunks each
    segment made), for a caller that has none of it (a stored Responses generation finished
    after a restart). `choices`: instead of `tokens`, one entry a choice of an `n` > 1 chat
    stream."""

    tokens: Annotated[list[TokenId], Meta(max_length=MAX_RESUME_TOKENS)] = []
    text: str | None = None
    segments: Annotated[list[Annotated[int, Meta(ge=0)]], Meta(max_length=MAX_RESUME_TOKENS)] | None = None
    id: Annotated[str, Meta(max_length=128)] | None = None
    created: Annotated[int, Meta(ge=0, le=2**53)] | None = None
    resend: bool = False
    choices: Annotated[list[ChoiceResume], Meta(min_length=2, max_length=16)] | None = None


class SamplingFields(msgspec.Struct, kw_only=True):
    """Fields shared by chat and text completions."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Temperature | None = None
    top_p: Probability | None = None
    top_k: TopK | None = None
    min_p: Probability | None = None
    seed: Seed | None = None
    repetition_penalty: RepetitionPenalty | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_context_size: PenaltyContext | None = None  # the reference's and mlx-lm's; default 256
    presence_context_size: PenaltyContext | None = None
    frequency_context_size: PenaltyContext | None = None
    xtc_probability: Probability | None = None  # XTC (exclude top choices); EOS and newline exempt
    xtc_threshold: XtcThreshold | None = None
    logit_bias: Annotated[dict[str, Bias], Meta(max_length=MAX_LOGIT_BIAS)] | None = None
    max_tokens: TokenCount | None = None
    stop: Stop | Annotated[list[Stop], Meta(max_length=MAX_STOPS)] | None = None
    n: NumChoices = 1
    user: str | None = None
    priority: Priority | None = None  # None: the key's default (process.PRIORITY_HEADER), else 0
    adapter: AdapterSpec | None = None  # mlxd's: a LoRA adapter id, "a+b" to stack, "none" for the base
    speculation: bool | None = None  # mlxd's: false decodes without drafts where the model has them
    resume: Resume | None = None  # mlxd's: continue a reply already partly delivered
    curve: Curve | None = None  # the curve sampler (protocol/curve.py): a drawn transfer curve...
    hlg: Hlg | None = None  # ... or the HLG tone curve's knobs, over the model's default
    response_format: Any = None  # checked by mlxd.engine.chat.grammar.response_format_grammar
    # vLLM's structured-output fields, held as response_format is (guided_format)
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Meta(min_length=1, max_length=1024)] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: TokenCount | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Annotated[str, Meta(max_length=32)] | None = None  # passed to the chat template
    tools: Any = None  # checked by mlxd.engine.chat.tools.check_tools (a 400 naming the field)
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    # str, list of token ids, or a one-element list of either (msgspec can't union two list types).
    prompt: str | list[Any]
    echo: bool = False
    suffix: str | None = None
    logprobs: Annotated[int, Meta(ge=0, le=5)] | None = None
    best_of: Annotated[int, Meta(ge=1, le=20)] | None = None


GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")


def held_format(req: SamplingFields) -> tuple[Any, str]:
    """The `response_format` a request's reply is held to, and the field it came from: its own,
    or one made of vLLM's `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` (a
    Lark grammar, as llguidance reads it) or `structured_outputs` (`json`, `regex`, `choice`,
    `grammar`, `json_object`). More than one of them is a 400 naming the second."""
    named = [(name, getattr(req, name)) for name in GUIDED if getattr(req, name) is not None]
    own = req.response_format if req.response_format not in (None, {"type": "text"}) else None
    if own is not None:
        named.insert(0, ("response_format", own))
    if len(named) > 1:
        raise APIError(400, f"{named[0][0]} and {named[1][0]} both hold the reply; send one.", param=named[1][0])
    if not named:
        return req.response_format, "response_format"
    name, value = named[0]
    if name == "response_format":
        return value, name
    if name == "structured_outputs":
        return structured_format(value), name
    return guided(name.removeprefix("guided_"), value, name), name


def structured_format(spec: dict[str, Any]) -> Any:
    kinds = [k for k in ("json", "regex", "choice", "grammar", "json_object") if spec.get(k) not in (None, False)]
    if len(kinds) != 1:
        raise APIError(400, "structured_outputs needs exactly one of json, regex, choice, grammar, json_object.",
                       param="structured_outputs")
    if kinds[0] == "json_object":
        return {"type": "json_object"}
    return guided(kinds[0], spec[kinds[0]], f"structured_outputs.{kinds[0]}")


def guided(kind: str, value: Any, param: str) -> dict[str, Any]:
    """One of vLLM's guided forms as a response_format (a 400 naming `param` when malformed)."""
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise APIError(400, f"{param} is a string that is not JSON.", param=param) from None
        if not isinstance(value, dict | bool):
            raise APIError(400, f"{param} must be a JSON Schema (an object).", param=param)
        return {"type": "json_schema", "json_schema": {"name": "guided", "schema": value}}
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise APIError(400, f"{param} must be a list of non-empty strings.", param=param)
        return {"type": "regex", "regex": "(" + "|".join(re.escape(c) for c in value) + ")"}
    if not isinstance(value, str) or not value:
        raise APIError(400, f"{param} must be a non-empty string.", param=param)
    return {"type": "regex", "regex": value} if kind == "regex" else {"type": "lark", "lark": value}


def stop_list(stop: str | list[str] | None) -> list[str]:
    """Normalize `stop` to a list and bound it."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOPS:
        raise APIError(400, f"At most {MAX_STOPS} stop sequences are supported, got {len(stops)}.", param="stop")
    return stops


# Arguments of the tokenizer's apply_chat_template that a client must not set through
# chat_template_kwargs (they would swap the template or change what comes back).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "chat_template", "tokenize", "return_dict", "return_tensors", "add_generation_prompt",
    "continue_final_message", "tools", "documents", "padding", "truncation", "max_length",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "conversation",
})


MAX_CHOICES = 16  # n: the rows one request may take in the batch lane


def check_common(req: SamplingFields, max_n: int = 1) -> None:
    """Reject what this server cannot honour, rather than silently ignoring it."""
    if not 1 <= req.n <= max_n:
        raise APIError(400, "Only n=1 is supported here." if max_n == 1 else f"n may be 1 to {max_n}.", param="n")
    for key in req.logit_bias or {}:
        if not is_token_id_key(key):
            raise APIError(400, f"logit_bias keys must be token ids, got {key[:20]!r}.", param="logit_bias")
    if (resume := req.resume) is not None:
        if resume.choices is not None:
            if len(resume.choices) != req.n:
                raise APIError(400, f"resume.choices has {len(resume.choices)} entries; n is {req.n}.",
                               param="resume.choices")
            if resume.tokens or resume.text is not None or resume.resend:
                raise APIError(400, "resume.choices comes without tokens, text or resend.", param="resume.choices")
        elif req.n != 1:
            raise APIError(400, "resume continues one reply: n must be 1, or resume.choices gives each.",
                           param="resume")
        if resume.tokens and resume.text is not None:
            raise APIError(400, "resume takes tokens or text, not both.", param="resume.text")
        for where, part in ((f"resume.choices[{i}]", c) for i, c in enumerate(resume.choices or [])):
            check_segments(where, part.tokens, part.segments)
        check_segments("resume", resume.tokens, resume.segments)


def check_segments(where: str, tokens: list[int], segments: list[int] | None) -> None:
    if segments is not None and sum(segments) != len(tokens):
        raise APIError(400, f"{where}.segments add up to {sum(segments)}, but there are {len(tokens)} tokens.",
                       param=f"{where}.segments")


def is_token_id_key(key: str) -> bool:
    """Whether a logit_bias key spells a token id: ASCII digits only (int() takes '٣' and ' 3')."""
    return key.isascii() and key.isdigit() and len(key) <= MAX_TOKEN_ID_DIGITS


# `reasoning_effort` on the chat API: "none" turns a template's thinking off, a level on (and is
# passed to the template, which may set the depth from it: gpt-oss's do). Anthropic's `max` too.
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def check_chat(req: ChatCompletionRequest) -> None:
    """Validate a chat request beyond what its types say."""
    check_common(req, MAX_CHOICES)
    if req.reasoning_effort is not None and req.reasoning_effort not in REASONING_EFFORTS:
        raise APIError(400, f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}; "
                       f"got {req.reasoning_effort!r}.", param="reasoning_effort")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(req.chat_template_kwargs or {}))
    if reserved:
        raise APIError(400, f"chat_template_kwargs may not set {', '.join(reserved)}.", param="chat_template_kwargs")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true.", param="top_logprobs")


def check_completion(req: CompletionRequest) -> None:
    """Validate a text completion request beyond what its types say."""
    check_common(req)
    if req.suffix:
        raise APIError(400, "suffix is not supported.", param="suffix")
    if (req.best_of or 1) != 1:
        raise APIError(400, "Only best_of=1 is supported.", param="best_of")
    completion_prompt(req)


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int for t in value)


def completion_prompt(req: CompletionRequest) -> str | list[int]:
    """The single prompt of a completion request: text or token ids; 400 otherwise."""
    prompt = req.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and (isinstance(prompt[0], str) or _is_token_list(prompt[0])):
        prompt = prompt[0]
    if isinstance(prompt, str) or _is_token_list(prompt):
        return prompt
    raise APIError(
        400, "prompt must be a string or a list of token ids (one prompt per request).", param="prompt"
    )


def message_text(msg: ChatMessage, index: int) -> str | None:
    """The text of a message's content; non-text parts are a 400."""
    if msg.content is None or isinstance(msg.content, str):
        return msg.content
    texts = []
    for j, part in enumerate(msg.content):
        where = f"messages[{index}].content[{j}]"
        if part.get("type") != "text":
            raise APIError(400, f"Content part type {part.get('type')!r} is not supported; only 'text' parts are.", param=where)
        if not isinstance(part.get("text"), str):
            raise APIError(400, "A text content part needs a string 'text'.", param=where)
        texts.append(part["text"])
    return "".join(texts)


# ---- responses ----


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class SpeculationUsage(msgspec.Struct):
    """mlxd's: drafted tokens the model checked for this answer, and how many it kept."""

    proposed: int
    accepted: int


class Usage(msgspec.Struct, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = msgspec.field(default_factory=PromptTokensDetails)
    speculation: SpeculationUsage | None = None  # only where the answer was decoded with drafts


class AssistantMessage(msgspec.Struct, omit_defaults=True):
    role: str  # always there, as content is (null beside tool calls)
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None  # the same text, under the name the reference and several clients read


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None
    stop_reason: str | None = None  # vLLM's extension: the stop string that ended the reply


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    system_fingerprint: str | None = None


class Delta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None  # the same text (as AssistantMessage's)
    tool_calls: list[dict[str, Any]] | None = None


class ChunkChoice(msgspec.Struct):
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None
    stop_reason: str | None = None  # on the closing chunk: as ChatChoice's


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"


class TextChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None
    stop_reason: str | None = None  # as ChatChoice's


class Completion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage | None = None
    object: str = "text_completion"


class RenderedPrompt(msgspec.Struct):
    """The engine's answer to POST /v1/chat/render: the prompt a chat request becomes."""

    prompt_tokens: int
    token_ids: list[int]
    text: str
    context_window: int
    model: str


class ModelCard(msgspec.Struct):
    id: str
    created: int
    owned_by: str = "mlxd"
    object: str = "model"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"
