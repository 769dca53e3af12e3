"""An S3-compatible server on 127.0.0.1 for the tests (moto's server mode, in a thread of the test process), which
can be told to fail an upload from its N-th file on.

Ray Train and pyarrow reach it through the storage URI alone: `s3://bucket/runs?endpoint_override=127.0.0.1:PORT&
scheme=http&...` (pyarrow's `FileSystem.from_uri` reads those options, and Ray pickles the filesystem it made
from the URI to its controller and workers), so nothing has to be set in the environment of the session's Ray.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from werkzeug.serving import make_server

ACCESS_DENIED = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>AccessDenied</Code>'
                 b'<Message>Access Denied (injected by the test)</Message></Error>')


@dataclass
class FailUploads:
    """Refuse (403 AccessDenied, which no client retries) every request that writes a file under `prefix`, from
    the `at_file`-th distinct file written there on; `failed` holds the paths refused."""

    prefix: str
    at_file: int
    files: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


class S3Server:
    def __init__(self):
        self.fail: FailUploads | None = None
        self.lock = threading.Lock()
        app = DomainDispatcherApplication(create_backend_app)
        self.server = make_server("127.0.0.1", 0, self._middleware(app), threaded=True,
                                  request_handler=MotoRequestHandler)
        self.host, self.port = self.server.server_address[:2]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def _middleware(self, app):
        def call(environ, start_response):
            path, method = environ.get("PATH_INFO", ""), environ.get("REQUEST_METHOD")
            with self.lock:
                fail = self.fail
                refuse = False
                if fail is not None and method in ("PUT", "POST") and path.startswith(fail.prefix):
                    if path not in fail.files:
                        fail.files.append(path)
                    refuse = fail.files.index(path) + 1 >= fail.at_file
                    if refuse and path not in fail.failed:
                        fail.failed.append(path)
            if refuse:
                start_response("403 Forbidden", [("Content-Type", "application/xml"),
                                                  ("Content-Length", str(len(ACCESS_DENIED)))])
                return [ACCESS_DENIED]
            return app(environ, start_response)

        return call

    def start(self) -> S3Server:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.thread.join(10)

    def uri(self, path: str) -> str:
        """A pyarrow / Ray storage URI for `bucket/path` on this server (moto takes any credentials)."""
        return (f"s3://minilm:minilm-secret@{path}?endpoint_override={self.host}:{self.port}&scheme=http"
                f"&region=us-east-1&allow_bucket_creation=true")

    def filesystem(self):
        import pyarrow.fs as pafs

        return pafs.FileSystem.from_uri(self.uri("bucket"))[0]

    def fail_uploads(self, prefix: str, at_file: int) -> FailUploads:
        """From now on refuse writes under /`prefix` from its `at_file`-th file on (until `heal`)."""
        with self.lock:
            self.fail = FailUploads("/" + prefix.lstrip("/"), at_file)
            return self.fail

    def heal(self) -> None:
        with self.lock:
            self.fail = None
