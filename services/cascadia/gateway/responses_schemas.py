"""Request and response bodies of OpenAI's Responses API (`/v1/responses`), the subset a text model serves.

Input items and content parts of kinds this gateway does not serve (images, files, reasoning, hosted
tools) are read as `Unsupported` so that the request is refused naming the item, not with a union's
list of every shape it failed to match.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from cascadia.gateway.schemas import (
    MAX_SEED,
    MAX_TOOLS,
    JsonSchemaFormat,
    Metadata,
    PromptTokensDetails,
    ServiceTier,
    Strict,
    TokenLogprob,
    ToolName,
    tagged,
)

MAX_INPUT_ITEMS = 4096
LOGPROBS_INCLUDE = "message.output_text.logprobs"


class InputText(Strict):
    type: Literal["input_text"]
    text: str


class OutputTextPart(Strict):
    """An earlier answer's text, as a response's output gave it (annotations and log-probs are not read)."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class RefusalPart(Strict):
    type: Literal["refusal"]
    refusal: str


ContentPart = tagged({"input_text": InputText, "output_text": OutputTextPart, "refusal": RefusalPart})


class MessageItem(Strict):
    """A message: `{"role", "content"}` as chat takes it, or a response's output message given back."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | Annotated[list[ContentPart], Field(max_length=MAX_INPUT_ITEMS)]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None


class FunctionCallItem(Strict):
    """An earlier call of a function, as a response's output gave it."""

    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1)]
    name: ToolName
    arguments: str = Field(description="The arguments as JSON text.")
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(Strict):
    """A function's result, answering the call `call_id` names."""

    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1)]
    output: str | Annotated[list[ContentPart], Field(max_length=MAX_INPUT_ITEMS)]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


InputItem = tagged(
    {"message": MessageItem, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem},
    default="message",
)


class FunctionTool(Strict):
    type: Literal["function"]
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="JSON schema of the arguments; default any object.")
    strict: bool | None = Field(None, description="Calls are always held to the parameters' schema.")


ResponseTool = tagged({"function": FunctionTool})


class FunctionToolChoice(Strict):
    type: Literal["function"]
    name: ToolName


class TextFormatText(Strict):
    type: Literal["text"]


class TextFormatJsonObject(Strict):
    type: Literal["json_object"]


class TextFormatJsonSchema(JsonSchemaFormat):
    type: Literal["json_schema"]


TextFormatChoice = Annotated[TextFormatText | TextFormatJsonObject | TextFormatJsonSchema, Field(discriminator="type")]


class TextConfig(Strict):
    format: TextFormatChoice | None = None
    verbosity: Literal["low", "medium", "high"] | None = Field(None, description="Accepted; it changes nothing.")


class ResponseStreamOptions(Strict):
    include_obfuscation: bool | None = Field(None, description="Accepted; events carry no obfuscation padding.")


class ConversationRef(Strict):
    id: str


class ResponseInput(Strict):
    """What a response reads: the fields `POST /v1/responses` and `/v1/responses/input_tokens` share."""

    input: str | Annotated[list[InputItem], Field(max_length=MAX_INPUT_ITEMS)] | None = Field(
        None, description="Text (a user message) or a list of messages, function calls and their outputs."
    )
    instructions: str | None = Field(
        None, description="A system message put first; not carried over to responses that follow this one."
    )
    previous_response_id: str | None = Field(
        None, description="Continue a stored response: its input and output come before this input."
    )
    conversation: str | ConversationRef | None = Field(
        None,
        description="A conversation (/v1/conversations) whose items come before this input; the input and "
        "the output are added to it.",
    )
    tools: Annotated[list[ResponseTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    truncation: Literal["auto", "disabled"] | None = Field(
        None,
        description="disabled (the default): a conversation over the context is refused; auto: its oldest turns "
        "are left out of the prompt until it fits.",
    )
    reasoning: dict[str, Any] | None = Field(None, description="Refused unless empty: these models do not reason.")


class ResponseRequest(ResponseInput):
    model: str = Field(description="Name of a model from GET /v1/models.")
    store: bool | None = Field(None, description="Keep the response for GET and previous_response_id; default true.")
    max_output_tokens: int | None = Field(None, ge=1, description="Default: the rest of the context.")
    temperature: float | None = Field(None, ge=0, le=2, description="0 is greedy; default 1.")
    top_p: float | None = Field(None, gt=0, le=1, description="Nucleus sampling; default 1.")
    top_logprobs: int | None = Field(None, ge=0, le=20)
    include: list[Literal["message.output_text.logprobs"]] | None = Field(
        None, description="message.output_text.logprobs: each output token's log-prob."
    )
    stream: bool | None = False
    stream_options: ResponseStreamOptions | None = None
    background: bool | None = Field(
        None,
        description="Answer at once with the response queued, and generate it apart from this request: poll "
        "GET /v1/responses/{id} until its status is no longer queued or in_progress; cancel it with POST "
        "/v1/responses/{id}/cancel. Needs store.",
    )
    metadata: Metadata | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = Field(
        None, description="Accepted: prompts that start alike share state without being told."
    )
    service_tier: ServiceTier | None = Field(None, description="Accepted; every request is served alike.")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="Extension: same seed and parameters, same tokens.")
    top_k: int | None = Field(
        None, ge=0, le=2**31 - 1, description="Extension: keep only the k most likely tokens; 0 is off."
    )

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ()) or bool(self.top_logprobs)


class InputTokensRequest(ResponseInput):
    model: str | None = Field(None, description="Name of a model from GET /v1/models; default the one served.")


class InputTokenCount(BaseModel):
    object: Literal["response.input_tokens"] = "response.input_tokens"
    input_tokens: int = Field(
        description="The prompt's tokens as a response would render it; with truncation auto, after the oldest "
        "turns it would leave out."
    )


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = Annotated[OutputMessage | OutputFunctionCall, Field(discriminator="type")]


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: PromptTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseBody(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    status: Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: Literal["auto", "disabled"] = "disabled"
    store: bool = True
    background: bool = False
    conversation: ConversationRef | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None


class InputItemList(BaseModel):
    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: Literal[True] = True


MAX_ADDED_ITEMS = 20  # OpenAI's bound on the items one request adds to a conversation


class ConversationCreate(Strict):
    items: Annotated[list[InputItem], Field(max_length=MAX_ADDED_ITEMS)] | None = Field(
        None, description="The conversation's first items: messages, function calls and their outputs."
    )
    metadata: Metadata | None = None


class ConversationUpdate(Strict):
    metadata: Metadata


class ItemsCreate(Strict):
    items: Annotated[list[InputItem], Field(min_length=1, max_length=MAX_ADDED_ITEMS)]


class ConversationBody(BaseModel):
    id: str
    object: Literal["conversation"] = "conversation"
    created_at: int
    metadata: dict[str, str]


class DeletedConversation(BaseModel):
    id: str
    object: Literal["conversation.deleted"] = "conversation.deleted"
    deleted: bool = True
