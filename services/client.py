"""Streaming command-line client of the public API: `llmserve chat "..."` and
`llmserve generate --prompt ... | --token-ids ...`. Prints text as it arrives; `--json`
prints one JSON object per response message instead (machine-readable).

`llmserve chat --tools tools.json` offers the model functions (OpenAI's tool list: objects
`{"type": "function", "function": {"name", "description", "parameters"}}`, or the function
objects alone); the calls it makes are printed as `[tool call] name(arguments)` lines after
its text. A reasoning model's thinking (`--reasoning-parser` on the server) goes to stderr."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, TextIO

import grpc
from google.protobuf.json_format import MessageToDict

from protos.llmserve.v1 import text_pb2, text_pb2_grpc
from services.common.grpc_server import CHANNEL_OPTIONS
from services.common.public_sampling_fields import OPTIONAL_SAMPLING_FIELDS

DEFAULT_TARGET = "127.0.0.1:50051"


def add_connection_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=DEFAULT_TARGET, help="tokenizer tier host:port")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("LLMSERVE_API_KEY") or None,
        help="sent as 'authorization: Bearer KEY' (default: env LLMSERVE_API_KEY)",
    )
    parser.add_argument("--tls", action="store_true", help="TLS, trusting the system's CAs")
    parser.add_argument("--tls-ca", default=None, help="TLS, trusting this PEM CA bundle")


def public_channel(target: str, *, tls: bool = False, tls_ca: str | None = None) -> grpc.Channel:
    """A channel to the public API: plaintext, or TLS (with `tls_ca` or the system's CAs)."""
    if not tls and tls_ca is None:
        return grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
    roots = Path(tls_ca).read_bytes() if tls_ca else None
    credentials = grpc.ssl_channel_credentials(root_certificates=roots)
    return grpc.secure_channel(target, credentials, options=CHANNEL_OPTIONS)


def auth_metadata(api_key: str | None) -> list[tuple[str, str]]:
    """The call metadata carrying an API key (none without one)."""
    return [("authorization", f"Bearer {api_key}")] if api_key else []


def _channel(args: argparse.Namespace) -> grpc.Channel:
    return public_channel(args.target, tls=args.tls, tls_ca=args.tls_ca)


def _add_common_flags(parser: argparse.ArgumentParser) -> None:
    add_connection_flags(parser)
    parser.add_argument("--temperature", type=float, default=None, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None, help="-1 = off")
    parser.add_argument("--min-p", type=float, default=None)
    parser.add_argument("--repetition-penalty", type=float, default=None)
    parser.add_argument("--presence-penalty", type=float, default=None)
    parser.add_argument("--frequency-penalty", type=float, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--min-new-tokens", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument(
        "--n",
        type=int,
        default=None,
        help="completions of the prompt (1-16); more than one are printed whole, one by one",
    )
    parser.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        help="most draft tokens (n-gram lookup) a step may verify, 0-16; 0 = off; "
        "unset = the server's --speculative-ngram",
    )
    parser.add_argument(
        "--stop", action="append", default=[], help="stop string (repeatable); not printed"
    )
    parser.add_argument("--stop-token-id", type=int, action="append", default=[])
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--logprobs", type=int, default=0, help="top-n alternatives per token")
    parser.add_argument("--request-id", default="", help="echoed in the server's logs")
    parser.add_argument("--deadline-ms", type=int, default=0, help="0 = none")
    parser.add_argument("--timeout-s", type=float, default=None, help="gRPC deadline")
    parser.add_argument("--model", default="", help="must match ListModels when set")
    parser.add_argument(
        "--tenant-id", default="", help="requests of different tenants share no cached KV"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per message")


def sampling_from_args(args: argparse.Namespace) -> text_pb2.SamplingParams:
    """Only the flags given are set, so the server's defaults apply to the rest."""
    sampling = text_pb2.SamplingParams(
        stop=args.stop,
        stop_token_ids=args.stop_token_id,
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
    )
    for name in OPTIONAL_SAMPLING_FIELDS:
        value = getattr(args, name)
        if value is not None:
            setattr(sampling, name, value)
    return sampling


def request_from_args(args: argparse.Namespace) -> text_pb2.GenerateRequest:
    request = text_pb2.GenerateRequest(
        request_id=args.request_id,
        sampling=sampling_from_args(args),
        deadline_ms=args.deadline_ms,
        model=args.model,
        tenant_id=args.tenant_id,
    )
    if args.command == "chat":
        request.prompt_name = args.prompt_name
        if args.system:
            request.messages.append(text_pb2.ChatMessage(role="system", content=args.system))
        request.messages.append(text_pb2.ChatMessage(role="user", content=args.prompt))
        if args.tools:
            request.tools.extend(tools_from_file(args.tools))
        request.tool_choice.CopyFrom(tool_choice(args.tool_choice))
    elif args.token_ids is not None:
        request.prompt_token_ids.extend(_parse_token_ids(args.token_ids))
    else:
        request.prompt = args.prompt
    return request


def tools_from_file(path: str) -> list[text_pb2.Tool]:
    """The tools a JSON file lists, as OpenAI's API takes them (or the bare functions)."""
    try:
        listed = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SystemExit(f"llmserve: error: --tools {path}: {exc}") from exc
    if not isinstance(listed, list):
        raise SystemExit(f"llmserve: error: --tools {path}: must hold a JSON list of tools")
    tools = []
    for index, item in enumerate(listed):
        function = item.get("function", item) if isinstance(item, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise SystemExit(f"llmserve: error: --tools {path}: tool {index} has no name")
        tools.append(
            text_pb2.Tool(
                name=function["name"],
                description=str(function.get("description", "")),
                parameters=json.dumps(function.get("parameters") or {}),
                strict=bool(function.get("strict", False)),
            )
        )
    return tools


def tool_choice(value: str) -> text_pb2.ToolChoice:
    """auto, none, required, or a function's name."""
    modes = {
        "auto": text_pb2.ToolChoice.AUTO,
        "none": text_pb2.ToolChoice.NONE,
        "required": text_pb2.ToolChoice.REQUIRED,
    }
    if value in modes:
        return text_pb2.ToolChoice(mode=modes[value])
    return text_pb2.ToolChoice(mode=text_pb2.ToolChoice.FUNCTION, function_name=value)


def _parse_token_ids(value: str) -> list[int]:
    try:
        return [int(part) for part in value.replace(",", " ").split()]
    except ValueError as exc:
        raise SystemExit(f"llmserve: error: --token-ids: {exc}") from exc


def stream(
    request: text_pb2.GenerateRequest,
    *,
    target: str,
    timeout_s: float | None,
    as_json: bool,
    out: TextIO = sys.stdout,
    err: TextIO = sys.stderr,
    api_key: str | None = None,
    tls: bool = False,
    tls_ca: str | None = None,
) -> int:
    """Prints the stream; returns the exit code (0, or 1 on a gRPC error). Several choices
    (n > 1) arrive interleaved, so each is printed whole once the stream ends."""
    last: text_pb2.GenerateResponse | None = None
    several = request.sampling.n > 1 and not as_json
    choices: dict[int, list[str]] = {}
    calls: dict[tuple[int, int], list[str]] = {}  # (choice, call) → [name, arguments]
    with public_channel(target, tls=tls, tls_ca=tls_ca) as channel:
        stub = text_pb2_grpc.TextGenerationStub(channel)
        try:
            metadata = auth_metadata(api_key)
            for response in stub.Generate(request, timeout=timeout_s, metadata=metadata):
                last = response
                for piece in response.tool_calls:
                    call = calls.setdefault((response.index, piece.index), ["", ""])
                    call[0] += piece.name
                    call[1] += piece.arguments
                if response.reasoning_text and not as_json:
                    err.write(response.reasoning_text)
                    err.flush()
                if as_json:
                    out.write(json.dumps(_to_dict(response), ensure_ascii=False) + "\n")
                elif several:
                    choices.setdefault(response.index, []).append(response.text)
                else:
                    out.write(response.text)
                out.flush()
        except grpc.RpcError as exc:
            _report_error(exc, as_json, out, err)
            return 1
    for index in sorted(choices):
        out.write(f"--- choice {index} ---\n{''.join(choices[index])}\n")
    if not as_json:
        for (index, _), (name, arguments) in sorted(calls.items()):
            choice = f" (choice {index})" if several else ""
            out.write(f"\n[tool call{choice}] {name}({arguments})")
    if not as_json and last is not None:
        out.write("\n")
        usage, timings = last.usage, last.timings
        err.write(
            f"[{last.finish_reason}] prompt {usage.prompt_tokens} tokens "
            f"({usage.cached_prompt_tokens} cached), completion {usage.completion_tokens}; "
            f"queue {timings.queue_ms:.1f} ms, ttft {timings.ttft_ms:.1f} ms, "
            f"total {timings.total_ms:.1f} ms, id {last.request_id}\n"
        )
    return 0


def _to_dict(message: Any) -> dict[str, Any]:
    return MessageToDict(message, preserving_proto_field_name=True)


def _report_error(exc: grpc.RpcError, as_json: bool, out: TextIO, err: TextIO) -> None:
    code = exc.code() if isinstance(exc, grpc.Call) else grpc.StatusCode.UNKNOWN
    details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
    if as_json:
        out.write(json.dumps({"error": {"code": code.name, "message": details}}) + "\n")
        out.flush()
    err.write(f"\nllmserve: error: {code.name}: {details}\n")


def cmd_generate(args: argparse.Namespace) -> int:
    return stream(
        request_from_args(args),
        target=args.target,
        timeout_s=args.timeout_s,
        as_json=args.json,
        api_key=args.api_key,
        tls=args.tls,
        tls_ca=args.tls_ca,
    )


def add_parser(subparsers: Any) -> None:
    chat = subparsers.add_parser("chat", help="stream a chat answer from a running server")
    chat.add_argument("prompt", help="the user message")
    chat.add_argument("--system", default="", help="a system message before it")
    chat.add_argument(
        "--prompt-name", default="", help="a registered system prompt (see `llmserve prompts`)"
    )
    chat.add_argument(
        "--tools",
        default=None,
        metavar="FILE.json",
        help="functions the model may call: a JSON list in OpenAI's tools format",
    )
    chat.add_argument(
        "--tool-choice",
        default="auto",
        help="auto, none, required, or the name of the one function to call (default: auto)",
    )
    _add_common_flags(chat)
    chat.set_defaults(func=cmd_generate)

    generate = subparsers.add_parser(
        "generate", help="stream a raw completion (text or token ids) from a running server"
    )
    source = generate.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text (no chat template)")
    source.add_argument("--token-ids", help="prompt token ids, e.g. '1,2,3' or '1 2 3'")
    _add_common_flags(generate)
    generate.set_defaults(func=cmd_generate)


def cmd_prompts(args: argparse.Namespace) -> int:
    """Register, list or delete named system prompts; prints each result as JSON."""
    metadata = auth_metadata(args.api_key)
    with _channel(args) as channel:
        stub = text_pb2_grpc.TextGenerationStub(channel)
        try:
            if args.prompts_command == "register":
                text = Path(args.file).read_text() if args.file else args.text
                result: Any = stub.RegisterPrompt(
                    text_pb2.RegisterPromptRequest(
                        name=args.name,
                        system_prompt=text,
                        ttl_s=args.ttl_s,
                        tenant_id=args.tenant_id,
                    ),
                    timeout=args.timeout_s,
                    metadata=metadata,
                )
            elif args.prompts_command == "list":
                result = stub.ListPrompts(
                    text_pb2.ListPromptsRequest(tenant_id=args.tenant_id),
                    timeout=args.timeout_s,
                    metadata=metadata,
                )
            else:
                result = stub.DeletePrompt(
                    text_pb2.DeletePromptRequest(name=args.name, tenant_id=args.tenant_id),
                    timeout=args.timeout_s,
                    metadata=metadata,
                )
        except grpc.RpcError as exc:
            _report_error(exc, False, sys.stdout, sys.stderr)
            return 1
    print(json.dumps(_to_dict(result), ensure_ascii=False))
    return 0


def add_prompts_parser(subparsers: Any) -> None:
    prompts = subparsers.add_parser(
        "prompts", help="named system prompts: register, list, delete (on a running server)"
    )
    actions = prompts.add_subparsers(dest="prompts_command", required=True)
    register = actions.add_parser("register", help="register (or refresh) a system prompt")
    register.add_argument("name")
    text = register.add_mutually_exclusive_group(required=True)
    text.add_argument("--text", help="the system prompt")
    text.add_argument("--file", help="read the system prompt from this file")
    register.add_argument("--ttl-s", type=int, default=0, help="0 = the server's default")
    delete = actions.add_parser("delete", help="delete a registered prompt and unpin its KV")
    delete.add_argument("name")
    listing = actions.add_parser("list", help="the registered prompts")
    for action in (register, delete, listing):
        add_connection_flags(action)
        action.add_argument("--tenant-id", default="")
        action.add_argument("--timeout-s", type=float, default=300.0)
        action.set_defaults(func=cmd_prompts)
