"""The Open Responses routes on the OpenAI door's app."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response

from services.tokenizer.http.common import error_response
from services.tokenizer.http.openai.errors import not_found_route
from services.tokenizer.http.openai.responses_api.door import ResponsesDoor


def add_responses_routes(app: FastAPI, door: ResponsesDoor) -> None:
    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        return await door.create(request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(request: Request, response_id: str) -> Response:
        return await door.retrieve(request, response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str) -> Response:
        return await door.delete(request, response_id)

    @app.post("/v1/responses/{path:path}")
    async def no_such_route(request: Request, path: str) -> Response:
        # Sub-routes we do not serve (compact, cancel, input_items...): 404 as any unknown
        # route, not the 405 a GET-only path would give.
        return error_response(not_found_route(request.method, request.url.path))
