import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def s3_server():
    """A real S3 API server (moto's server mode, its own process) on 127.0.0.1, for the whole session."""
    from tests.s3_server import S3Server

    server = S3Server.start()
    yield server
    server.stop()


@pytest.fixture
def s3(s3_server, monkeypatch, request):
    """The AWS environment variables pointing at the session's S3 server, and a fresh bucket for this test."""
    import re

    for k, v in s3_server.env.items():
        monkeypatch.setenv(k, v)
    import zlib

    name = request.node.name.lower()  # a short readable part, and a digest so parametrized names stay distinct
    bucket = f"{re.sub(r'[^a-z0-9-]', '-', name)[:40].strip('-')}-{zlib.crc32(name.encode()):08x}"
    s3_server.make_bucket(bucket)
    s3_server.bucket = bucket
    return s3_server
