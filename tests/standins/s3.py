"""A protocol-level stand-in for an S3-compatible object store, for testing corral's s3 bundle
store through boto3 on loopback.

It serves, on one free 127.0.0.1 port of a uvicorn server in a thread, what boto3 sends for
the calls the store makes: PutObject (plain or ``aws-chunked`` bodies, as boto3 sends them with
its default checksums), the multipart upload boto3's ``upload_fileobj`` uses past 8 MB
(CreateMultipartUpload, UploadPart, CompleteMultipartUpload, AbortMultipartUpload),
GetObject and DeleteObject, path-style (``/bucket/key``) or virtual-hosted. Requests are signed
with AWS Signature V4; the stand-in checks the access key id in ``Authorization`` and answers
403 ``InvalidAccessKeyId`` otherwise, and 404 ``NoSuchBucket``/``NoSuchKey`` as S3 does, with
S3's XML error bodies.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import threading
import time
from types import TracebackType
from typing import Any, Self
from urllib.parse import parse_qs, unquote

import uvicorn

from tests.standins.asgi import listen, read_body

START_TIMEOUT_S = 5.0
_CREDENTIAL = re.compile(r"Credential=([^/]+)/")


def decode_aws_chunked(body: bytes) -> bytes:
    """The payload of an ``aws-chunked`` body: ``<hex size>[;ext]\\r\\n<data>\\r\\n`` chunks
    up to a zero-sized one, then trailers."""
    out, at = bytearray(), 0
    while True:
        end = body.index(b"\r\n", at)
        size = int(body[at:end].split(b";")[0], 16)
        if size == 0:
            return bytes(out)
        out += body[end + 2 : end + 2 + size]
        at = end + 2 + size + 2


class S3Standin:
    """``with S3Standin(bucket="b") as s3:`` ... ``s3.endpoint_url``, ``s3.objects``."""

    def __init__(self, *, bucket: str) -> None:
        self.bucket = bucket
        self.access_key = f"AKIA{secrets.token_hex(8).upper()}"
        self.secret_key = secrets.token_urlsafe(30)
        self.objects: dict[str, bytes] = {}
        self.uploads: dict[str, dict[int, bytes]] = {}
        self.requests: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._socket = listen("127.0.0.1")
        port = self._socket.getsockname()[1]
        self.endpoint_url = f"http://127.0.0.1:{port}"
        config = uvicorn.Config(self, log_level="warning", lifespan="off", log_config=None)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True
        )

    def __enter__(self) -> Self:
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the S3 stand-in did not start")
            time.sleep(0.01)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._socket.close()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = await read_body(receive)
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        if "aws-chunked" in headers.get("content-encoding", "") or headers.get(
            "x-amz-content-sha256", ""
        ).startswith("STREAMING-"):
            body = decode_aws_chunked(body)
        status, payload, extra = self._answer(scope, headers, body)
        raw = [(b"content-length", b"%d" % len(payload))]
        raw += [(k.encode(), v.encode()) for k, v in extra.items()]
        await send({"type": "http.response.start", "status": status, "headers": raw})
        await send({"type": "http.response.body", "body": payload})

    def _answer(
        self, scope: dict[str, Any], headers: dict[str, str], body: bytes
    ) -> tuple[int, bytes, dict[str, str]]:
        method, query = scope["method"], parse_qs(scope["query_string"].decode(), True)
        bucket, key = self._address(unquote(scope["path"]), headers.get("host", ""))
        with self._lock:
            self.requests.append((method, key))
        found = _CREDENTIAL.search(headers.get("authorization", ""))
        if found is None or found.group(1) != self.access_key:
            return _error(403, "InvalidAccessKeyId", "The AWS Access Key Id does not exist.")
        if bucket != self.bucket:
            return _error(404, "NoSuchBucket", "The specified bucket does not exist.")
        with self._lock:
            return self._object_call(method, query, key, body)

    def _address(self, path: str, host: str) -> tuple[str, str]:
        first, _, rest = path.lstrip("/").partition("/")
        if first == self.bucket or not host.startswith(self.bucket + "."):
            return first, rest
        return host.split(".", 1)[0], path.lstrip("/")  # virtual-hosted style

    def _object_call(
        self, method: str, query: dict[str, list[str]], key: str, body: bytes
    ) -> tuple[int, bytes, dict[str, str]]:
        etag = {"ETag": f'"{hashlib.md5(body, usedforsecurity=False).hexdigest()}"'}
        if method == "POST" and "uploads" in query:
            upload_id = secrets.token_hex(8)
            self.uploads[upload_id] = {}
            return _xml(
                "InitiateMultipartUploadResult", Bucket=self.bucket, Key=key, UploadId=upload_id
            )
        if "uploadId" in query:
            return self._multipart(method, query, key, body, etag)
        if method == "PUT":
            self.objects[key] = body
            return 200, b"", etag
        if method == "DELETE":
            self.objects.pop(key, None)
            return 204, b"", {}
        if method == "GET":
            return self._read(key)
        return _error(405, "MethodNotAllowed", "The specified method is not allowed.")

    def _read(self, key: str) -> tuple[int, bytes, dict[str, str]]:
        if key not in self.objects:
            return _error(404, "NoSuchKey", "The specified key does not exist.")
        return 200, self.objects[key], {"Content-Type": "binary/octet-stream"}

    def _multipart(
        self,
        method: str,
        query: dict[str, list[str]],
        key: str,
        body: bytes,
        etag: dict[str, str],
    ) -> tuple[int, bytes, dict[str, str]]:
        parts = self.uploads.get(query["uploadId"][0])
        if parts is None:
            return _error(404, "NoSuchUpload", "The specified upload does not exist.")
        if method == "PUT":
            parts[int(query["partNumber"][0])] = body
            return 200, b"", etag
        if method == "DELETE":
            self.uploads.pop(query["uploadId"][0])
            return 204, b"", {}
        self.objects[key] = b"".join(parts[number] for number in sorted(parts))
        self.uploads.pop(query["uploadId"][0])
        return _xml("CompleteMultipartUploadResult", Bucket=self.bucket, Key=key, ETag='"x"')


def _xml(root: str, **fields: str) -> tuple[int, bytes, dict[str, str]]:
    inner = "".join(f"<{name}>{value}</{name}>" for name, value in fields.items())
    document = f'<?xml version="1.0" encoding="UTF-8"?><{root}>{inner}</{root}>'
    return 200, document.encode(), {"Content-Type": "application/xml"}


def _error(status: int, code: str, message: str) -> tuple[int, bytes, dict[str, str]]:
    _, document, headers = _xml("Error", Code=code, Message=message)
    return status, document, headers
