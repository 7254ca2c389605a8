"""The tests' S3 server (``_procs/s3_server.py``) decides a conditional PUT the way S3 does.

The store's commit log publishes entry N with ``If-None-Match: *`` and trusts that of any
number of racing writers exactly one is told it created the object. moto looks the key up and
stores the object later, with nothing held in between; served on several threads, two
conditional PUTs of one key could both be answered 200 (the second overwrote the first), and
the crash test's s3 case lost an acknowledged send. The race is made certain here, not
waited for: moto's look-up of the key waits (up to a second) until both PUTs have made it.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from conftest import load_file, require_backend_module

# moto's dispatcher tells S3 requests by their signature's scope (not checked)
HOST = {"Host": "127.0.0.1", "Authorization": "AWS4-HMAC-SHA256 Credential=testing/20260101/"
        "us-east-1/s3/aws4_request, SignedHeaders=host, Signature=0"}


@pytest.fixture
def server():
    require_backend_module("moto.server")
    return load_file("dq_s3_server", Path(__file__).parent / "_procs" / "s3_server.py")


def test_two_racing_conditional_puts_of_one_key_have_one_winner(server, monkeypatch):
    from moto.s3.models import S3Backend
    from werkzeug.test import Client

    app = server.make_app()
    assert Client(app).put("/race-bucket", headers=HOST).status_code == 200

    both_looked = threading.Barrier(2, timeout=1.0)
    racing = threading.local()
    looked_together = []
    get_object = S3Backend.get_object

    def get_object_held_open(self, bucket_name, key_name, *args, **kwargs):
        found = get_object(self, bucket_name, key_name, *args, **kwargs)
        if getattr(racing, "on", False):
            try:
                both_looked.wait()
                looked_together.append(key_name)
            except threading.BrokenBarrierError:  # the other PUT waits for this one to end
                pass
        return found

    monkeypatch.setattr(S3Backend, "get_object", get_object_held_open)
    status: dict[int, int] = {}

    def put(me: int) -> None:
        racing.on = True
        status[me] = Client(app).put("/race-bucket/log/00000000000000000001.json",
                                     data=f"writer {me}".encode(),
                                     headers={**HOST, "If-None-Match": "*"}).status_code

    threads = [threading.Thread(target=put, args=(me,)) for me in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(status.values()) == [200, 412], (status, looked_together)
    winner = next(me for me, code in status.items() if code == 200)
    stored = Client(app).get("/race-bucket/log/00000000000000000001.json", headers=HOST)
    assert stored.get_data() == f"writer {winner}".encode()


def test_reads_are_not_held_behind_a_write(server, monkeypatch):
    """Only writes take the server's lock: a GET while a PUT is being handled is answered."""
    from moto.s3.models import S3Backend
    from werkzeug.test import Client

    app = server.make_app()
    client = Client(app)
    assert client.put("/read-bucket", headers=HOST).status_code == 200
    assert client.put("/read-bucket/a", data=b"a", headers=HOST).status_code == 200
    in_put, release = threading.Event(), threading.Event()
    put_object = S3Backend.put_object

    def slow_put(self, bucket_name, key_name, *args, **kwargs):
        if key_name == "b":
            in_put.set()
            release.wait(5)
        return put_object(self, bucket_name, key_name, *args, **kwargs)

    monkeypatch.setattr(S3Backend, "put_object", slow_put)
    writer = threading.Thread(
        target=lambda: Client(app).put("/read-bucket/b", data=b"b", headers=HOST))
    writer.start()
    try:
        assert in_put.wait(5)
        assert client.get("/read-bucket/a", headers=HOST).get_data() == b"a"
    finally:
        release.set()
        writer.join()
