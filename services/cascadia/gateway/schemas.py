"""Request and response bodies of the OpenAI API subset the gateway serves."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

MAX_STOP_STRINGS = 4
MAX_SEED = 2**63 - 1
# generations one request may start: its prompts times n (each is a stream on every stage)
MAX_CHOICES = 16
MAX_LOGIT_BIAS_TOKENS = 300  # OpenAI's own bound
MAX_CHOICE_TEXTS = 1024  # strings a structured_outputs.choice may list
MAX_TOOLS = 128  # OpenAI's own bound


class Strict(BaseModel):
    # Like OpenAI: an argument the server does not know is an error, not silently dropped; and no
    # coercion (a float token id or the string "5" for max_tokens is a client bug, not a request).
    model_config = ConfigDict(extra="forbid", strict=True)


class Unsupported(BaseModel):
    """An item, part or tool of a kind this gateway does not serve; refused by name after parsing."""

    model_config = ConfigDict(extra="allow")
    type: str


def tagged(known: dict[str, type[BaseModel]], default: str | None = None) -> Any:
    """A union over `known` by `type` (`default` where an item may leave it out), any other kind parsing
    as `Unsupported`."""

    def tag(value: Any) -> str:
        kind = value.get("type", default) if isinstance(value, dict) else getattr(value, "type", default)
        return kind if isinstance(kind, str) and kind in known else "unsupported"

    members = [Annotated[model, Tag(kind)] for kind, model in known.items()]
    members.append(Annotated[Unsupported, Tag("unsupported")])
    return Annotated[Union[tuple(members)], Discriminator(tag)]  # noqa: UP007 (built from a list)


MAX_METADATA_PAIRS = 16  # OpenAI's own bounds
Metadata = Annotated[
    dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
    Field(max_length=MAX_METADATA_PAIRS),
]
# every request is served alike: a tier asked for is accepted, and served as "default"
ServiceTier = Literal["auto", "default", "flex", "scale", "priority", "fast"]


class StreamOptions(Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = Field(None, description="Accepted; chunks carry no obfuscation padding.")


class JsonSchemaFormat(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema", description="Default: any JSON object.")
    strict: bool | None = Field(None, description="Always held to: the text matches the schema.")


class TextFormat(Strict):
    type: Literal["text"]


class JsonObjectFormat(Strict):
    type: Literal["json_object"]


class JsonSchemaResponseFormat(Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ChoiceTexts = Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_CHOICE_TEXTS)]


class StructuredOutputs(Strict):
    """Exactly one of its fields: the form the text must take."""

    json_schema: dict[str, Any] | None = Field(None, alias="json", description="A JSON schema.")
    regex: str | None = Field(None, min_length=1, description="A regular expression the whole text matches.")
    choice: ChoiceTexts | None = Field(None, description="The text is one of these strings.")
    grammar: str | None = Field(None, min_length=1, description="A context-free grammar, in Lark or GBNF syntax.")

    @model_validator(mode="after")
    def exactly_one(self) -> StructuredOutputs:
        given = [name for name in ("json_schema", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of json, regex, choice and grammar, not {len(given)}")
        return self


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaResponseFormat, Field(discriminator="type")]


Stop = Annotated[str, Field(min_length=1)] | Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=4)]


class SamplingFields(Strict):
    model: str = Field(description="Name of a model from GET /v1/models.")
    temperature: float | None = Field(None, ge=0, le=2, description="0 is greedy; default 1.")
    top_p: float | None = Field(None, gt=0, le=1, description="Nucleus sampling; default 1.")
    top_k: int | None = Field(
        None, ge=0, le=2**31 - 1, description="Extension: keep only the k most likely tokens; 0 is off."
    )
    n: int | None = Field(
        None,
        ge=1,
        le=MAX_CHOICES,
        description=f"Choices per prompt, sampled apart (a seed moves by the choice's index); at most "
        f"{MAX_CHOICES} choices a request over all its prompts.",
    )
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="Same seed and parameters: same tokens.")
    stop: Stop | None = Field(None, description="Up to 4 strings; text ends before the first one found.")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        None,
        max_length=MAX_LOGIT_BIAS_TOKENS,
        description="Token id (a decimal string) to a bias in [-100, 100] added to its logit before sampling.",
    )
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    user: str | None = None
    speculation: bool | None = Field(
        None, description="Extension: false decodes this request without drafted tokens; default: the router's."
    )
    response_format: ResponseFormat | None = Field(
        None,
        description="json_object: the text is one JSON object; json_schema: one JSON value matching the schema. "
        "Each token is sampled among those that keep the text inside it (on /v1/completions too).",
    )
    structured_outputs: StructuredOutputs | None = Field(
        None, description="Extension (as vLLM's): the text matches a JSON schema, a regex, a choice or a grammar."
    )
    # what OpenAI's API takes on chat and completions alike, as /v1/responses takes it: accepted, and what
    # cannot be honoured here refused by name
    metadata: Metadata | None = Field(None, description="Accepted; completions are not stored here.")
    store: bool | None = Field(
        None, description="false or absent: completions are not stored here (responses are: /v1/responses)."
    )
    safety_identifier: str | None = Field(None, max_length=64)
    prompt_cache_key: str | None = Field(
        None, description="Accepted: prompts that start alike share state without being told."
    )
    service_tier: ServiceTier | None = Field(None, description="Accepted; every request is served alike.")

    @field_validator("store")
    @classmethod
    def not_stored(cls, store: bool | None) -> bool | None:
        if store:
            raise ValueError("stored completions are not served here; /v1/responses stores responses")
        return store

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
Text = Annotated[str, Field(min_length=1)]
# a batch of prompts, as OpenAI accepts it: each prompt gets its own n choices
Prompt = Text | TokenIds | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_CHOICES)]
Prompt = Prompt | Annotated[list[Text], Field(min_length=1, max_length=MAX_CHOICES)]


class CompletionRequest(SamplingFields):
    prompt: Prompt = Field(description="Text, or token ids used exactly as given (no template, no BOS).")
    max_tokens: int | None = Field(16, ge=1, description="Tokens to generate at most.")
    logprobs: int | None = Field(None, ge=0, le=5, description="Log-probs of this many best tokens per position.")
    echo: bool | None = Field(
        None,
        description="The prompt's text before the completion's; with logprobs, each prompt token's log-prob given "
        "the ones before it (none for the first).",
    )
    best_of: int | None = Field(None, ge=0, le=20, description="1 (or absent) only: each choice is its own stream.")
    suffix: str | None = Field(None, description="Empty (or absent) only: text is not inserted before a suffix.")

    @field_validator("best_of")
    @classmethod
    def one_candidate(cls, best_of: int | None) -> int | None:
        if best_of is not None and best_of > 1:
            raise ValueError("best_of above 1 is not served; ask for n choices instead")
        return best_of

    @field_validator("suffix")
    @classmethod
    def no_insertion(cls, suffix: str | None) -> str | None:
        if suffix:
            raise ValueError("insertion before a suffix is not served")
        return suffix

    @property
    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, one or a batch."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]  # type: ignore[list-item]
        return list(self.prompt)  # type: ignore[arg-type]


class TextPart(Strict):
    type: Literal["text"]
    text: str


ChatContentPart = tagged({"text": TextPart})


ToolName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class CalledFunction(Strict):
    name: ToolName
    arguments: str = Field(description="The arguments as JSON text.")


class ToolCall(Strict):
    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[ChatContentPart], Field(min_length=1)] | None = None
    name: str | None = None
    tool_calls: Annotated[list[ToolCall], Field(min_length=1)] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # the call a tool message answers

    @model_validator(mode="after")
    def has_what_its_role_needs(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message, and only a tool message, has a tool_call_id")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(getattr(p, "text", "") for p in self.content)


class FunctionDefinition(Strict):
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="JSON schema of the arguments; default any object.")
    strict: bool | None = Field(None, description="Calls are always held to the parameters' schema.")


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: ToolName


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1, description="Default: the rest of the context.")
    max_completion_tokens: int | None = Field(None, ge=1, description="Same as max_tokens.")
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: Annotated[list[Tool], Field(min_length=1, max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None,
        description="auto (the default with tools): text or calls; required or a named function: calls only. "
        "Calls are held to the tools' schemas, in the <tool_call> markup where the model's template writes it "
        "or has no place for tools (auto needs that markup: a 400 otherwise).",
    )
    parallel_tool_calls: bool | None = Field(None, description="Several calls in one answer; default true.")
    modalities: list[Literal["text"]] | None = Field(None, description="Text only.")


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(
        0, description="Prompt tokens whose positions a finished stream's state held, not computed again."
    )


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # None for an echoed prompt's first token, which nothing precedes
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "cascadia"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: {"model": ErrorResponse} for code in codes}
