"""serving/accept.py: every waiting connection is accepted in one turn of the loop.

libuv takes one per turn, so a /health probe behind a burst of large-body connections
waited for each of them (issue: /health within 50 ms under 60 x 1 MB bodies). No timings:
the test counts what one ready-callback accepts, and that each got uvicorn's protocol.
"""

from __future__ import annotations

import asyncio
import json
import socket
from typing import ClassVar

import uvloop

from trae_groups.serving.accept import Acceptor


class Counting(asyncio.Protocol):
    made: ClassVar[list[Counting]] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        Counting.made.append(self)
        self.transport = transport


def test_one_ready_call_accepts_every_waiting_connection():
    async def main() -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        acceptor = Acceptor(loop, listener, Counting, backlog=128)
        loop.remove_reader(listener.fileno())  # drive it by hand: one call, as one turn
        clients = [socket.create_connection(listener.getsockname()) for _ in range(40)]
        acceptor._ready()
        in_one_turn = acceptor.accepted
        for _ in range(100):  # the protocols are attached on later turns (bounded)
            if len(Counting.made) == len(clients):
                break
            await asyncio.sleep(0.01)
        acceptor.close()
        for c in clients:
            c.close()
        for p in Counting.made:
            p.transport.close()
        listener.close()
        return in_one_turn, len(Counting.made)

    Counting.made = []
    assert uvloop.run(main()) == (40, 40)


def test_the_server_answers_through_the_acceptor(tmp_path):
    """A real uvicorn (ServerThread) on 127.0.0.1 takes its connections through it."""
    import urllib.request

    from trae_groups.serving.server import ServerThread, create_app

    graph = tmp_path / "g.yaml"
    graph.write_text(
        "name: g\ninputs: {text: str}\nnodes:\n"
        '  s: {function: "graph_functions:shout", args: {text: "{{ inputs.text }}"}}\n'
        "outputs: {y: s}\n"
    )
    with ServerThread(create_app([graph])) as server:
        for _ in range(3):
            with urllib.request.urlopen(f"{server.url}/health", timeout=30) as resp:
                assert resp.status == 200
        ask = urllib.request.Request(
            f"{server.url}/v1/graphs/g", b'{"inputs": {"text": "hi"}}',
            {"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(ask, timeout=30) as resp:
            assert json.loads(resp.read())["outputs"] == {"y": "HI"}
        assert [a.accepted >= 3 for a in server.server.acceptors] == [True]
