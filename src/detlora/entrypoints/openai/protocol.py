"""Request bodies of the OpenAI-compatible server (pydantic), with OpenAI's and vLLM's names.

Fields the server does not implement are refused with a 400 that names them (``tools``,
``suffix``, ``best_of`` != ``n``, ...); unknown fields are ignored, as OpenAI's server does.
Responses are built as plain dicts by the serving modules (cheaper per streamed chunk).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(OpenAIBaseModel):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(OpenAIBaseModel):
    """What completions and chat share: OpenAI's sampling fields and vLLM's extra ones."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None
    # vLLM's extras.
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False
    skip_special_tokens: bool = True


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    prompt_logprobs: int | None = None


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    add_generation_prompt: bool = True


class DecisionQuestion(OpenAIBaseModel):
    type: str
    criteria: Any = None
    instructions: Any = None


class DecisionsRequest(OpenAIBaseModel):
    """``POST /v1/decisions``: a state, optional instructions, named questions."""

    model: str | None = None
    state: Any
    instructions: Any = None
    questions: dict[str, DecisionQuestion]


class SystemOneRequest(OpenAIBaseModel):
    """``POST /v1/systemone`` (TypeSafe's shape): each question carries its instructions."""

    model: str | None = None
    state: Any
    questions: dict[str, DecisionQuestion]


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str
