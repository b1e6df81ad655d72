"""The Open Responses door (`POST /v1/responses`, `GET|DELETE /v1/responses/{id}`): request
bodies (body.py), the response object and its stream events (builder.py), stored responses
(store.py) and the route logic (door.py)."""
