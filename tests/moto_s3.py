"""A real S3 API for the tests: moto's server mode on 127.0.0.1, as zarr-python's own tests run it.

:class:`MotoS3` runs ``ThreadedMotoServer`` in this process. Its buckets live
in moto's in-process state, so :meth:`MotoS3.stop` then :meth:`MotoS3.start`
on the same port is an object store that was unreachable for a while and is
back with its objects: what an outage looks like to a client.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

REGION = "us-east-1"
ACCESS_KEY = "tenplex-test-key"
SECRET_KEY = "tenplex-test-secret"


class MotoS3:
    def __init__(self) -> None:
        self.port = 0
        self._server: Any = None
        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's request log

    def start(self) -> MotoS3:
        from moto.moto_server.threaded_moto_server import ThreadedMotoServer

        deadline = time.monotonic() + 30
        while True:
            try:
                server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
                server.start()
                break
            except OSError:  # the port of a stopped server, not yet free
                if self.port == 0 or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        self._server = server
        self.port = server.get_host_and_port()[1]
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    @property
    def running(self) -> bool:
        return self._server is not None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """The standard AWS environment a process needs to reach this server (what the chart sets on a node)."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": REGION}

    @property
    def options(self) -> dict[str, str]:
        """The same as persistent store options (endpoint and credentials)."""
        return {"endpoint": self.endpoint, "region": REGION, "access_key_id": ACCESS_KEY, "secret_access_key": SECRET_KEY}

    def client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY, region_name=REGION)

    def create_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name

    def objects(self, bucket: str, prefix: str = "") -> dict[str, int]:
        """Every object under ``prefix`` and its size."""
        out: dict[str, int] = {}
        for page in self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                out[obj["Key"]] = int(obj["Size"])
        return out

    def flip_bit(self, bucket: str, key: str, offset: int = 5) -> None:
        """Damage an object in place, as failing storage would."""
        c = self.client()
        data = bytearray(c.get_object(Bucket=bucket, Key=key)["Body"].read())
        data[offset] ^= 0x01
        c.put_object(Bucket=bucket, Key=key, Body=bytes(data))

    @contextmanager
    def down(self) -> Iterator[None]:
        """Unreachable inside the block (connections refused), back with its objects after it."""
        self.stop()
        try:
            yield
        finally:
            self.start()
