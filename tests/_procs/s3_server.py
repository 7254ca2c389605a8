"""Subprocess entry point: an S3 endpoint for the tests (not a test module).

Usage: ``python s3_server.py PORT``

moto's S3 implementation served by waitress, a production WSGI server. moto's own
``moto_server`` runs werkzeug's development server, which after every response drains the
socket with a blocking read and can deadlock with a client whose connection stays open; waitress
speaks HTTP/1.1 with keep-alive the way S3 clients expect.
"""

from __future__ import annotations

import sys

import waitress
from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app


def main() -> None:
    port = int(sys.argv[1])
    app = DomainDispatcherApplication(create_backend_app)
    waitress.serve(app, host="127.0.0.1", port=port, threads=8, _quiet=True)


if __name__ == "__main__":
    main()
