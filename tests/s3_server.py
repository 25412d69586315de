"""A real S3 API server on 127.0.0.1 for the tests: moto's server mode in its own process.

    server = S3Server.start()          # python -m moto.server on a free port; waits until it answers
    server.env                         # AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ... for this server
    server.make_bucket("ckpts")
    server.stop()

Only the standard AWS environment variables point the clients at it (plain http).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    def __init__(self, proc: subprocess.Popen, port: int):
        self.proc, self.port = proc, port
        self.endpoint = f"http://127.0.0.1:{port}"

    @classmethod
    def start(cls, timeout: float = 30.0) -> "S3Server":
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/moto-api/", timeout=1).read()
                return cls(proc, port)
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    proc.kill()
                    raise RuntimeError(f"moto server did not start on port {port} (exit {proc.poll()})") from None
                time.sleep(0.1)

    def env_for(self, endpoint: str | None = None) -> dict[str, str]:
        """The AWS environment variables that point a client at ``endpoint`` (default: the server)."""
        return {"AWS_ENDPOINT_URL": endpoint or self.endpoint, "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"}

    @property
    def env(self) -> dict[str, str]:
        return self.env_for()

    def boto(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="testing",
                            aws_secret_access_key="testing", region_name="us-east-1")

    def make_bucket(self, name: str) -> str:
        self.boto().create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def set_env(env: dict[str, str]) -> dict[str, str | None]:
    """Set ``env`` in os.environ; returns the previous values (for :func:`restore_env`)."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    return old


def restore_env(old: dict[str, str | None]) -> None:
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
