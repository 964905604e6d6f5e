"""A real S3 API on loopback for the tests: moto's server, and a fault proxy in front of it.

``S3Server`` starts moto's ``ThreadedMotoServer`` on 127.0.0.1 (a free port) and a small HTTP proxy that
forwards every request to it unchanged unless a fault is armed for the next matching request:

    slowdown   503 with S3's ``SlowDown`` error body (throttling)
    internal   500 ``InternalError``
    forbidden  403 ``AccessDenied`` (a bucket policy that refuses this identity)
    badkey     403 ``InvalidAccessKeyId`` (credentials the store does not know)
    expired    400 ``ExpiredToken`` (a session token past its end)
    reset      the connection is reset (RST) before any response byte
    drop       moto's real response, headers and the first half of the body, then the connection is closed
    short      moto's real response with its body cut in half and a Content-Length that says so (a body that
               looks whole to the HTTP client: only the size tells)

``method`` is the HTTP method a fault applies to (``"*"``: any); ``times`` how many requests it hits (``FOREVER``:
until :meth:`S3Server.disarm` -- a storm longer than any retry budget).

The clients under test talk to the proxy (``AWS_ENDPOINT_URL_S3``); the test that plants objects talks to moto
directly, so faults hit only the code under test. Nothing leaves 127.0.0.1.
"""

from __future__ import annotations

import http.client
import logging
import socket
import struct
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

FOREVER = 10**9
_REFUSALS = {"slowdown": ("SlowDown", 503, "Please reduce your request rate."),
             "internal": ("InternalError", 500, "We encountered an internal error."),
             "forbidden": ("AccessDenied", 403, "Access Denied"),
             "badkey": ("InvalidAccessKeyId", 403, "The AWS Access Key Id you provided does not exist in our records."),
             "expired": ("ExpiredToken", 400, "The provided token has expired.")}
_ERROR = ("<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>{code}</Code><Message>{msg}</Message>"
          "<RequestId>test</RequestId></Error>")


class Fault:
    def __init__(self, action: str, key: str, times: int, method: str = "GET") -> None:
        self.action, self.key, self.times, self.method = action, key, times, method


class _Proxy(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet: pytest shows stderr of failing tests only, keep it short
        pass

    def _fault(self):
        server = self.server
        with server.lock:
            for f in server.faults:
                if f.times > 0 and f.method in (self.command, "*") and f.key in self.path:
                    f.times -= 1
                    server.fired[f.action] = server.fired.get(f.action, 0) + 1
                    return f.action
        return None

    def _handle(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        action = self._fault()
        if action == "reset":
            self.close_connection = True
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()  # linger 0: the peer gets a RST, not a FIN
            return
        if action in _REFUSALS:
            code, status, msg = _REFUSALS[action]
            data = _ERROR.format(code=code, msg=msg).encode() if self.command != "HEAD" else b""
            self.send_response(status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        up = http.client.HTTPConnection(*self.server.upstream, timeout=30)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection", "keep-alive")}
        up.request(self.command, self.path, body=body, headers=headers)
        resp = up.getresponse()
        data = resp.read()
        up.close()
        self.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in ("transfer-encoding", "connection", "content-length", "server", "date"):
                self.send_header(k, v)
        # A HEAD has no body: its Content-Length is the object's, as moto sent it.
        if action == "short" and self.command == "GET" and len(data) > 1 and resp.status < 300:
            data = data[: len(data) // 2]
        length = resp.getheader("Content-Length", "0") if self.command == "HEAD" else str(len(data))
        self.send_header("Content-Length", length)
        self.end_headers()
        if action == "drop" and self.command == "GET" and len(data) > 1:
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        pass  # a client that hangs up (a killed data worker) is not the proxy's error


class S3Server:
    """moto on loopback + the fault proxy; ``endpoint`` is the proxy's URL, ``direct`` moto's own."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto logs every request otherwise
        self.moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.moto.start()
        host, port = self.moto.get_host_and_port()
        self.direct = f"http://{host}:{port}"
        self.proxy = _Server(("127.0.0.1", 0), _Proxy)
        self.proxy.upstream, self.proxy.faults, self.proxy.fired = (host, port), [], {}
        self.proxy.lock = threading.Lock()
        self._thread = threading.Thread(target=self.proxy.serve_forever, daemon=True)
        self._thread.start()
        self.endpoint = f"http://127.0.0.1:{self.proxy.server_address[1]}"

    def arm(self, action: str, key: str, times: int = 1, method: str = "GET") -> Fault:
        f = Fault(action, key, times, method)
        with self.proxy.lock:
            self.proxy.faults.append(f)
        return f

    def disarm(self) -> dict:
        with self.proxy.lock:
            self.proxy.faults.clear()
            fired, self.proxy.fired = self.proxy.fired, {}
        return fired

    def client(self):
        """An s3fs filesystem straight to moto (no faults): for planting, replacing and deleting objects."""
        import s3fs

        return s3fs.S3FileSystem(endpoint_url=self.direct, skip_instance_cache=True)

    def stop(self) -> None:
        self.proxy.shutdown()
        self.proxy.server_close()
        self.moto.stop()
