"""The Open Responses routes on the OpenAI door's app."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response

from services.tokenizer.openai_http.responses_api.door import ResponsesDoor


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
