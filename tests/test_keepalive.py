"""Keepalive on the controller's channels: a stream to a controller that stops answering
(stopped here with SIGSTOP: its kernel still acknowledges TCP, its HTTP/2 side says nothing, as
a hung or silent host's) fails within seconds on the client's side, so an agent or a spare
knows, instead of waiting for TCP to give up."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid

import grpc
import pytest
from flashckpt.proto import controller_pb2 as pb
from flashckpt.proto import controller_pb2_grpc as pb_grpc

from flashckpt.faults import control

SERVE = """
import asyncio, sys
from flashckpt.agent.controller import Controller, start

async def main():
    server, port = await start(Controller(None, node_timeout=60), "127.0.0.1:0", sys.argv[1])
    print(port, flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


@pytest.mark.timeout(120)
def test_a_stream_to_a_controller_that_stops_answering_fails_within_seconds():
    token = uuid.uuid4().hex
    proc = subprocess.Popen([sys.executable, "-c", SERVE, token], stdout=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        port = int(proc.stdout.readline())
        endpoint = control.Endpoint(f"127.0.0.1:{port}", token)

        async def stream() -> tuple[str, float]:
            async with endpoint.channel() as channel:
                call = pb_grpc.ControllerStub(channel).Connect(metadata=endpoint.metadata())
                await call.write(pb.NodeReport(job="ka", node="n0", agent_id="a", seq=1))
                await call.read()  # answered: the stream is up
                os.kill(proc.pid, signal.SIGSTOP)
                stopped = time.monotonic()
                try:
                    await asyncio.wait_for(call.read(), 15)
                    return "answered", time.monotonic() - stopped
                except grpc.aio.AioRpcError as exc:
                    return exc.code().name, time.monotonic() - stopped
                except TimeoutError:
                    return "still waiting", time.monotonic() - stopped

        what, took = asyncio.run(stream())
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    print(f"stream to a stopped controller failed after {took:.2f}s ({what})")
    assert what == "UNAVAILABLE", (what, took)
    assert took < (control.KEEPALIVE_MS + control.KEEPALIVE_TIMEOUT_MS) / 1000 + 4, took
