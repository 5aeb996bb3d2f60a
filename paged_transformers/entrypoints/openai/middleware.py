"""``RequestGuard``: the checks every HTTP request passes before a route sees it (a pure ASGI middleware, so
streamed responses are not buffered): the API key on ``/v1`` paths, the body size limit, and the
``X-Request-Id`` header echoed on the response."""

import hmac
import json

from .protocol import error_body


class RequestGuard:
    """Args:
        app: the ASGI app guarded.
        api_key: when set, ``/v1`` paths need ``Authorization: Bearer <api_key>`` (401 otherwise), as in vLLM.
        max_body_bytes: bodies over this many bytes get a 413, by their ``Content-Length`` before they are read,
            or while they are read when they come chunked.
    """

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) or max_body_bytes <= 0:
            raise ValueError(f"max_body_bytes must be a positive integer, got {max_body_bytes!r}")
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.expected is not None and scope["path"].startswith("/v1") and not hmac.compare_digest(
            headers.get(b"authorization", b""), self.expected
        ):
            return await _send_error(send, 401, "Unauthorized: a missing or wrong API key")
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            return await _send_error(send, 413, f"the request body is over {self.max_body_bytes} bytes")
        if length is None and scope["method"] in ("POST", "PUT", "PATCH"):
            receive = await self._read_chunked(receive)
            if receive is None:
                return await _send_error(send, 413, f"the request body is over {self.max_body_bytes} bytes")
        request_id = headers.get(b"x-request-id")
        if request_id is not None:
            send = _with_header(send, b"x-request-id", request_id)
        return await self.app(scope, receive, send)

    async def _read_chunked(self, receive):
        """Read a body of unknown length; a ``receive`` replaying it, or None when it is too large."""
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                return None
            if message["type"] != "http.request" or not message.get("more_body"):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()

        return replay


def _with_header(send, name: bytes, value: bytes):
    async def wrapped(message):
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), (name, value)]}
        await send(message)

    return wrapped


async def _send_error(send, status: int, message: str) -> None:
    body = json.dumps(error_body(status, message)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
