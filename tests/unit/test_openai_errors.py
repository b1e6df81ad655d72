"""Typed errors → HTTP status, headers and OpenAI's error body."""

from __future__ import annotations

import pytest

from services.contracts.errors import (
    AlreadyExistsError,
    CapacityError,
    ConflictError,
    DeadlineExceededError,
    DependencyUnavailableError,
    InternalError,
    InvalidRequestError,
    ModelLoadError,
    NotFoundError,
    PermissionDeniedError,
    PromptTooLongError,
    QueueFullError,
    UnauthenticatedError,
)
from services.tokenizer.http.openai.errors import (
    RETRY_AFTER_S,
    http_error,
    http_param,
    not_found_route,
)


@pytest.mark.parametrize(
    ("exc", "status", "type_", "code", "grpc_code"),
    [
        (InvalidRequestError("top_p", "must be in (0, 1]"), 400, "invalid_request_error", None,
         "INVALID_ARGUMENT"),
        (CapacityError("needs 90 blocks, 64 exist"), 400, "invalid_request_error",
         "context_length_exceeded", "INVALID_ARGUMENT"),
        (UnauthenticatedError("invalid API key"), 401, "authentication_error", "invalid_api_key",
         "UNAUTHENTICATED"),
        (PermissionDeniedError("needs an admin key"), 403, "permission_error", None,
         "PERMISSION_DENIED"),
        (NotFoundError("prompt_name", "no prompt 'bot'"), 404, "not_found_error", "not_found",
         "NOT_FOUND"),
        (NotFoundError("model", "unknown model 'gpt-4'"), 404, "not_found_error",
         "model_not_found", "NOT_FOUND"),
        (AlreadyExistsError("LoRA adapter 'sql' is loaded already"), 409,
         "invalid_request_error", "already_exists", "ALREADY_EXISTS"),
        (ConflictError("no LoRA slot free"), 409, "invalid_request_error", "conflict",
         "FAILED_PRECONDITION"),
        (QueueFullError("512 waiting"), 429, "rate_limit_error", "queue_full",
         "RESOURCE_EXHAUSTED"),
        (DependencyUnavailableError("no scheduler"), 503, "service_unavailable", None,
         "UNAVAILABLE"),
        (DeadlineExceededError("deadline of 100 ms passed"), 504, "timeout", "deadline_exceeded",
         "DEADLINE_EXCEEDED"),
        (InternalError("the scheduler failed"), 500, "server_error", None, "INTERNAL"),
        (ModelLoadError("bad file"), 500, "server_error", None, "INTERNAL"),
    ],
)  # fmt: skip
def test_each_typed_error_maps_to_its_status(
    exc: Exception, status: int, type_: str, code: str | None, grpc_code: str
) -> None:
    error = http_error(exc)
    assert error.status == status
    assert error.type == type_
    assert error.code == code
    assert error.grpc_code_name == grpc_code
    body = error.body()
    assert set(body) == {"error"}
    assert body["error"] == {
        "message": error.message,
        "type": type_,
        "param": error.param,
        "code": code,
    }
    assert error.message  # never an empty explanation


@pytest.mark.parametrize(
    "exc", [QueueFullError("512 waiting"), DependencyUnavailableError("no scheduler")]
)
def test_back_off_statuses_carry_retry_after(exc: Exception) -> None:
    headers = http_error(exc).headers
    assert headers == {"Retry-After": str(RETRY_AFTER_S)}
    assert int(headers["Retry-After"]) > 0


@pytest.mark.parametrize(
    ("retry_after_ms", "header"), [(None, "1"), (1, "1"), (1000, "1"), (1001, "2"), (9500, "10")]
)
def test_a_full_queue_sends_the_scheduler_hint_as_retry_after_rounded_up(
    retry_after_ms: int | None, header: str
) -> None:
    error = http_error(QueueFullError("full", retry_after_ms=retry_after_ms))
    assert error.status == 429
    assert error.headers == {"Retry-After": header}


def test_401_asks_for_a_bearer_token() -> None:
    assert http_error(UnauthenticatedError("missing API key")).headers == {
        "WWW-Authenticate": "Bearer"
    }


@pytest.mark.parametrize(
    "exc",
    [
        InvalidRequestError("top_p", "bad"),
        PermissionDeniedError("no"),
        NotFoundError("model", "no"),
        DeadlineExceededError("late"),
        InternalError("broke"),
        RuntimeError("boom"),
    ],
)
def test_other_statuses_carry_no_extra_headers(exc: Exception) -> None:
    assert http_error(exc).headers == {}


def test_the_param_of_a_not_found_error_is_its_field() -> None:
    error = http_error(NotFoundError("prompt_name", "no prompt 'bot'"))
    assert error.param == "prompt_name"
    assert error.message == "no prompt 'bot'"


def test_an_invalid_request_names_its_param_in_param_and_message() -> None:
    error = http_error(InvalidRequestError("messages[1].role", "must be user or assistant"))
    assert error.param == "messages[1].role"
    assert error.message == "messages[1].role: must be user or assistant"


def test_an_invalid_request_about_the_whole_body_has_no_param() -> None:
    error = http_error(InvalidRequestError("", "the body must be a JSON object"))
    assert error.param is None
    assert error.message == "the body must be a JSON object"


@pytest.mark.parametrize(("chat", "param"), [(True, "messages"), (False, "prompt")])
def test_a_prompt_too_long_is_context_length_exceeded(chat: bool, param: str) -> None:
    exc = PromptTooLongError("prompt", "the prompt has 40 tokens but the context length is 32")
    error = http_error(exc, chat=chat)
    assert (error.status, error.type, error.code) == (
        400,
        "invalid_request_error",
        "context_length_exceeded",
    )
    assert error.param == param
    assert "40 tokens" in error.message


@pytest.mark.parametrize(
    ("field", "chat_param", "completions_param"),
    [
        ("sampling.max_new_tokens", "max_completion_tokens", "max_tokens"),
        ("sampling.min_new_tokens", "min_tokens", "min_tokens"),
        ("sampling.logprobs", "top_logprobs", "logprobs"),
        ("sampling.top_p", "top_p", "top_p"),
        ("sampling.stop[2]", "stop[2]", "stop[2]"),
        ("prompt_token_ids", "prompt", "prompt"),
        ("prompt", "messages", "prompt"),
        ("messages[1].role", "messages[1].role", "messages[1].role"),
        ("tenant_id", "tenant_id", "tenant_id"),
        ("", "", ""),
    ],
)
def test_http_param_spells_fields_as_the_http_api_does(
    field: str, chat_param: str, completions_param: str
) -> None:
    assert http_param(field, chat=True) == chat_param
    assert http_param(field, chat=False) == completions_param


def test_an_invalid_sampling_field_is_reported_under_its_http_name() -> None:
    exc = InvalidRequestError("sampling.max_new_tokens", "must be at most 512")
    assert http_error(exc, chat=True).param == "max_completion_tokens"
    assert http_error(exc, chat=False).param == "max_tokens"
    assert http_error(exc, chat=False).message == "max_tokens: must be at most 512"


def test_an_unknown_exception_is_500_without_its_message() -> None:
    secret = "password=hunter2 at /srv/models/secret.gguf"
    error = http_error(RuntimeError(secret))
    assert (error.status, error.type, error.code) == (500, "server_error", None)
    assert "hunter2" not in error.message and secret not in str(error.body())
    assert "RuntimeError" in error.message
    assert error.grpc_code_name == "INTERNAL"


def test_an_unknown_route() -> None:
    error = not_found_route("POST", "/v1/embeddings")
    assert (error.status, error.type, error.code) == (404, "not_found_error", "not_found")
    assert "POST /v1/embeddings" in error.message


def test_a_bad_request_id_names_the_header_it_came_in() -> None:
    error = http_error(InvalidRequestError("request_id", "must be at most 128 characters"))
    assert (error.status, error.param) == (400, "X-Request-Id")
