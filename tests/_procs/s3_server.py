"""Subprocess entry point: an S3 endpoint for the tests (not a test module).

Usage: ``python s3_server.py [PORT]``

With no PORT (or 0) the system picks a free port; the server prints ``listening on PORT`` on
standard output once it listens, so that test sessions started side by side (pytest-xdist's
workers) each get a server of their own without racing for a port picked in advance.

moto's S3 implementation served by waitress, a production WSGI server. moto's own
``moto_server`` runs werkzeug's development server, which after every response drains the
socket with a blocking read and can deadlock with a client whose connection stays open; waitress
speaks HTTP/1.1 with keep-alive the way S3 clients expect.

Requests that write (anything but GET, HEAD and OPTIONS) are handled one at a time
(:func:`make_app`). moto decides a conditional PUT (``If-None-Match: *``) by looking the key
up and then, further down, storing the object, with nothing held in between; waitress runs
requests on 8 threads, so two conditional PUTs of one key could both pass the look-up and
both be answered 200, the second replacing the first. S3 decides a conditional PUT
atomically (exactly one creates the object; a racing one gets 412 or 409), and the store's
commit log counts on it: with moto's race two writers each believed they had published the
same log entry, and the sends of the one overwritten were lost (test_group_crash.py's s3 case
failed so on a loaded machine: two returned sends at one _seq, or an entry starting past the
end of the one before it). tests/test_s3_server.py makes the race certain.
"""

from __future__ import annotations

import sys
import threading

from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app

_READS = frozenset({"GET", "HEAD", "OPTIONS"})


class _OneWriteAtATime:
    """WSGI middleware: writing requests run under one lock, so that moto's look-up of a
    conditional PUT and its store are one step, as S3's are. Reads run concurrently."""

    def __init__(self, app) -> None:
        self.app = app
        self.lock = threading.Lock()

    def __call__(self, environ, start_response):
        if environ.get("REQUEST_METHOD", "GET") in _READS:
            return self.app(environ, start_response)
        with self.lock:  # waitress has read the request's body already: no waiting on a client
            result = self.app(environ, start_response)
            try:
                return [b"".join(result)]
            finally:
                close = getattr(result, "close", None)
                if close is not None:
                    close()


def make_app():
    """moto's S3 as a WSGI application, its conditional writes decided atomically."""
    return _OneWriteAtATime(DomainDispatcherApplication(create_backend_app))


def main() -> None:
    import waitress

    port = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    server = waitress.create_server(make_app(), host="127.0.0.1", port=port, threads=8)
    print(f"listening on {server.effective_port}", flush=True)
    server.run()


if __name__ == "__main__":
    main()
