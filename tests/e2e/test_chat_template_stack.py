"""A real stack serving a model that ships no chat template (the embedded GGUF rewritten
without `tokenizer.chat_template`): both doors refuse chat requests, naming `messages`, and
serve completions; the same model under --chat-template (a file, or a built-in's name) chats,
at every door."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import grpc
import httpx
import pytest

from kernels.cpu_extension import DISABLE_ENV_VAR
from protos.llmserve.v1 import text_pb2
from services.common.model_source import embedded_model_path
from services.stack import RunningStack, running_stack
from services.text.builtin_chat_templates import builtin_chat_template
from services.text.chat_template import ChatMessage
from services.text.model_tokenizer import ModelTokenizer
from tests.e2e.conftest import STACK_FLAGS, STARTUP_TIMEOUT_S

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Name three fruits."}]
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def gguf_without(source: Path, destination: Path, *keys: str) -> Path:
    """A copy of `source` without the metadata `keys`, its tensors as they are."""
    import gguf

    reader = gguf.GGUFReader(source)
    architecture = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    writer = gguf.GGUFWriter(destination, arch=architecture, endianess=reader.endianess)
    for field in reader.fields.values():
        # The writer adds the architecture itself; GGUF.* are the header's own counts.
        skipped = field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF.")
        if skipped or field.name in keys:
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
    for tensor in reader.tensors:
        writer.add_tensor_info(
            tensor.name,
            tensor.data.shape,
            tensor.data.dtype,
            tensor.data.nbytes,
            tensor.tensor_type,
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in reader.tensors:
        writer.write_tensor_data(tensor.data, tensor_endianess=reader.endianess)
    writer.close()
    return destination


# One replica, no Redis, float32 weights (the torch path's fast case).
EDGE_FLAGS = ["--tokenizer-replicas", "1", "--no-redis", "--quantization", "none"]


def edge_stack(extra: list[str]) -> AbstractContextManager[RunningStack]:
    """The test stack, smaller, with workers that skip building the C++ CPU kernels
    (minutes on a busy machine): these stacks only check what the edge lets through."""
    return running_stack(
        [*STACK_FLAGS, *EDGE_FLAGS, *extra],
        startup_timeout_s=STARTUP_TIMEOUT_S,
        env={DISABLE_ENV_VAR: "0"},
    )


@pytest.fixture(scope="module")
def bare_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("bare-model")
    path = gguf_without(
        embedded_model_path(), directory / "SmolLM2-no-template.gguf", "tokenizer.chat_template"
    )
    tokenizer = ModelTokenizer.from_path(path)
    assert tokenizer.chat_template is None
    assert tokenizer.encode("Hello") == ModelTokenizer.from_path(embedded_model_path()).encode(
        "Hello"
    )
    return path


@pytest.fixture(scope="module")
def bare_stack(bare_model: Path) -> Iterator[RunningStack]:
    with edge_stack(["--model", str(bare_model)]) as running:
        yield running
    assert running.returncode == 0


def chat_body(stack: RunningStack) -> dict[str, object]:
    return {"model": model_name(stack), "messages": MESSAGES, "max_tokens": 4, "temperature": 0}


def model_name(stack: RunningStack) -> str:
    return str(httpx.get(f"{stack.http}/models", timeout=10).json()["data"][0]["id"])


def grpc_chat(stack: RunningStack) -> list[text_pb2.GenerateResponse]:
    request = text_pb2.GenerateRequest(
        messages=[text_pb2.ChatMessage(**m) for m in MESSAGES],
        sampling=text_pb2.SamplingParams(max_new_tokens=4, temperature=0),
    )
    return list(stack.text_stub().Generate(request, timeout=120))


def test_chat_is_refused_at_both_doors(bare_stack: RunningStack) -> None:
    chat = httpx.post(f"{bare_stack.http}/chat/completions", json=chat_body(bare_stack), timeout=60)
    assert chat.status_code == 400, chat.text
    error = chat.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "messages")
    assert "no chat template" in error["message"] and "completions work" in error["message"]
    with pytest.raises(grpc.RpcError) as refused:
        grpc_chat(bare_stack)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "messages: this model has no chat template" in refused.value.details()


def test_completions_still_work(bare_stack: RunningStack) -> None:
    body = {"model": model_name(bare_stack), "prompt": "The sky is", "max_tokens": 4}
    completion = httpx.post(f"{bare_stack.http}/completions", json=body, timeout=120)
    assert completion.status_code == 200, completion.text
    assert completion.json()["usage"]["completion_tokens"] >= 1
    request = text_pb2.GenerateRequest(
        prompt="The sky is", sampling=text_pb2.SamplingParams(max_new_tokens=4)
    )
    responses = list(bare_stack.text_stub().Generate(request, timeout=120))
    assert responses[-1].usage.completion_tokens >= 1


def test_the_chat_template_option_makes_the_model_chat(bare_model: Path, tmp_path: Path) -> None:
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML)
    with edge_stack(["--model", str(bare_model), "--chat-template", str(template)]) as stack:
        chat = httpx.post(f"{stack.http}/chat/completions", json=chat_body(stack), timeout=120)
        assert chat.status_code == 200, chat.text
        tokenizer = ModelTokenizer.from_path(bare_model).with_chat_template(CHATML)
        prompt_ids = tokenizer.apply_chat_template([ChatMessage(**m) for m in MESSAGES])
        assert chat.json()["usage"]["prompt_tokens"] == len(prompt_ids)
        responses = grpc_chat(stack)
        assert responses[-1].usage.prompt_tokens == len(prompt_ids)
        assert responses[-1].usage.completion_tokens >= 1
    assert stack.returncode == 0


def test_a_builtin_template_name_makes_the_model_chat(bare_model: Path) -> None:
    """--chat-template chatml, as llama.cpp's server takes it: the built-in renders the prompt
    (SmolLM2 was tuned on ChatML), at the OpenAI and the Anthropic doors alike."""
    with edge_stack(["--model", str(bare_model), "--chat-template", "chatml"]) as stack:
        chat = httpx.post(f"{stack.http}/chat/completions", json=chat_body(stack), timeout=120)
        assert chat.status_code == 200, chat.text
        source = builtin_chat_template("chatml")
        assert source is not None
        tokenizer = ModelTokenizer.from_path(bare_model).with_chat_template(source)
        prompt_ids = tokenizer.apply_chat_template([ChatMessage(**m) for m in MESSAGES])
        assert chat.json()["usage"]["prompt_tokens"] == len(prompt_ids)
        body = {"model": model_name(stack), "max_tokens": 4, "messages": MESSAGES}
        message = httpx.post(f"{stack.http}/messages", json=body, timeout=120)
        assert message.status_code == 200, message.text
        usage = message.json()["usage"]
        assert usage["input_tokens"] + usage["cache_read_input_tokens"] == len(prompt_ids)
    assert stack.returncode == 0
