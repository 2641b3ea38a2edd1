"""A real S3 API on loopback for tests: moto's standalone server (ThreadedMotoServer) on
127.0.0.1 and a free port, spoken to over HTTP by s3fs and boto3 exactly as a real store is.
No in-process mocking of any client: the processes under test (torchrun ranks, the CLI) find it
through AWS_ENDPOINT_URL. If it cannot start, the test fails with the reason (never a skip)."""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest


@dataclass
class S3Server:
    endpoint: str
    env: dict[str, str]  # what a process needs to reach it (AWS_ENDPOINT_URL and dummy credentials)

    def new_bucket(self) -> str:
        import boto3

        name = f"fsdpkit-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                     aws_access_key_id="test", aws_secret_access_key="test").create_bucket(Bucket=name)
        return name


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def s3_server() -> Iterator[S3Server]:
    try:
        from moto.server import ThreadedMotoServer
    except ImportError as e:
        pytest.fail(f"moto's S3 server is not installed ({e}): make .venv/.installed installs the dev extra "
                    "(moto[server], s3fs, boto3)")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    try:
        server.start()
    except Exception as e:  # noqa: BLE001 - any failure to start is the test's failure, with the reason
        pytest.fail(f"could not start moto's S3 server on 127.0.0.1:{port}: {type(e).__name__}: {e}")
    endpoint = f"http://127.0.0.1:{port}"
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
           "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # this process's clients (s3fs in the test itself) too
    try:
        yield S3Server(endpoint=endpoint, env=env)
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
