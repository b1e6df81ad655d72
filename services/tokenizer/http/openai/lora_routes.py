"""vLLM's routes to load and unload LoRA adapters at run time, on the OpenAI door, for admin
keys only (any caller when no key is configured); lora_adapters.py does the work on every
scheduler of the pool.

    POST /v1/load_lora_adapter    {"lora_name": "sql", "lora_path": "/adapters/sql"}
      200 {"object": "lora_adapter", "name": "sql", "path": "/adapters/sql",
           "parent": <the served model>, "num_loaded_schedulers": 2}
    POST /v1/unload_lora_adapter  {"lora_name": "sql"}
      200 {"object": "lora_adapter", "name": "sql", "deleted": true,
           "num_unloaded_schedulers": 2}

vLLM answers these with plain text ("Success: LoRA adapter 'sql' added successfully."); JSON
here, so a client reads how many schedulers hold the adapter. Clients of vLLM's routes read the
status only. Errors take the door's shape (openai_http/errors.py): 400 naming lora_name or
lora_path (also when a scheduler's worker finds the adapter does not fit the model: then
the adapter's own field, "r", "target_modules"...), 401, 403 for a key that is not an
admin's, 404 when unloading a name no scheduler holds, 409 when loading a loaded name.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from services.contracts.errors import InvalidRequestError, LLMServeError, NotFoundError
from services.tokenizer.access.keys import AccessPolicy, require_admin
from services.tokenizer.generation import Generator
from services.tokenizer.http.common import error_response, json_response, validated_body
from services.tokenizer.http.openai.errors import http_error

log = logging.getLogger(__name__)

HTTP_PARAMS = {"name": "lora_name", "path": "lora_path"}
"""The LoRA calls' fields (lora.proto's spelling) as these routes' bodies spell them."""


class LoadLoraAdapterBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_path: str


class UnloadLoraAdapterBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str


class LoraRoutes:
    """The routes' logic, over the tier's generator (its adapters) and keys."""

    def __init__(self, generator: Generator, access: AccessPolicy) -> None:
        self.generator = generator
        self.access = access

    async def load(self, request: Request) -> Response:
        try:
            caller = self.access.authenticate(request.headers.get("authorization"))
            require_admin(caller, "POST /v1/load_lora_adapter")
            base = self.generator.model.name
            body = validated_body(LoadLoraAdapterBody, await request.body())
            info = await self.generator.adapters.load(body.lora_name, body.lora_path, base)
        except LLMServeError as exc:
            return _refused("lora adapter not loaded", exc)
        log.info(
            "lora adapter loaded",
            extra={
                "lora_name": info.name,
                "schedulers": info.num_loaded_schedulers,
                "key_id": caller.key_id,
            },
        )
        return json_response(
            {
                "object": "lora_adapter",
                "name": info.name,
                "path": info.path,
                "parent": info.parent,
                "num_loaded_schedulers": info.num_loaded_schedulers,
            }
        )

    async def unload(self, request: Request) -> Response:
        try:
            caller = self.access.authenticate(request.headers.get("authorization"))
            require_admin(caller, "POST /v1/unload_lora_adapter")
            self.generator.model  # noqa: B018 - raises while the tier is loading
            body = validated_body(UnloadLoraAdapterBody, await request.body())
            num_unloaded = await self.generator.adapters.unload(body.lora_name)
        except LLMServeError as exc:
            return _refused("lora adapter not unloaded", exc)
        log.info(
            "lora adapter unloaded",
            extra={
                "lora_name": body.lora_name,
                "schedulers": num_unloaded,
                "key_id": caller.key_id,
            },
        )
        return json_response(
            {
                "object": "lora_adapter",
                "name": body.lora_name,
                "deleted": True,
                "num_unloaded_schedulers": num_unloaded,
            }
        )


def _refused(what: str, exc: LLMServeError) -> Response:
    error = http_error(_http_fields(exc))
    log.info(what, extra={"status": error.status, "error": error.message})
    return error_response(error)


def _http_fields(exc: LLMServeError) -> LLMServeError:
    """A field error named as these routes' bodies spell the field."""
    if isinstance(exc, (InvalidRequestError, NotFoundError)) and exc.field in HTTP_PARAMS:
        return type(exc)(HTTP_PARAMS[exc.field], exc.message)
    return exc


def add_lora_routes(app: FastAPI, routes: LoraRoutes) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        return await routes.load(request)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        return await routes.unload(request)
