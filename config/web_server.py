"""daphne, with a connection check that costs what changed rather than what is connected:

    python -m config.web_server <daphne's arguments>

daphne's application_checker runs every second over every connection (has its application ended? has
it outlived its socket?): 60 ms of the one event loop every second with 50,000 idle volunteers, so every
page waited behind it. Here it visits only the connections that disconnected or whose application ended
since (a set filled by daphne's own hooks), with daphne's own logic, and keeps those still pending.

It also keeps the garbage collector's full collections from walking what lives long (config/heap.py)."""

from __future__ import annotations

import asyncio
from typing import Any

from daphne.cli import CommandLineInterface
from daphne.server import Server

from config.heap import Heap


class WatchingServer(Server):
    connections: dict[Any, dict[str, Any]]  # daphne's, by protocol

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.watched: set[Any] = set()
        self.heap = Heap()

    def run(self) -> None:
        self.heap.start()  # the application is loaded by now
        super().run()

    def protocol_disconnected(self, protocol: Any) -> None:
        super().protocol_disconnected(protocol)
        self.watched.add(protocol)

    def create_application(self, protocol: Any, scope: dict[str, Any]) -> asyncio.Queue[Any] | None:
        queue: asyncio.Queue[Any] | None = super().create_application(protocol, scope)
        instance = self.connections.get(protocol, {}).get("application_instance")
        if instance is not None:
            instance.add_done_callback(lambda _: self.watched.add(protocol))
        return queue

    def application_checker(self) -> None:
        """daphne's check over the watched connections only; those it did not reap stay watched."""
        self.heap.tick()
        watched, self.watched = self.watched, set()
        everyone: dict[Any, dict[str, Any]] = self.connections
        self.connections = {p: everyone[p] for p in watched if p in everyone}
        try:
            super().application_checker()
        finally:
            left, self.connections = self.connections, everyone
            for protocol in watched & everyone.keys():
                if protocol in left:
                    everyone[protocol] = left[protocol]
                    self.watched.add(protocol)
                else:
                    del everyone[protocol]
                    unlink(protocol)


def unlink(protocol: Any) -> None:
    """Break the reference cycles a finished connection leaves (found with gc.DEBUG_SAVEALL), so that its
    objects are freed by their reference counts, even once frozen (config/heap.py): autobahn resolves a
    WebSocket's `is_closed` with the protocol itself, and Twisted's HTTP channel keeps the request that
    became a WebSocket (or was cut off) in its `requests`, which point back at the channel."""
    if getattr(protocol, "is_closed", None) is not None:
        protocol.is_closed = None
    channel = getattr(protocol, "channel", None)
    if channel is not None and protocol in getattr(channel, "requests", ()):
        channel.requests.remove(protocol)


class WatchingCommandLineInterface(CommandLineInterface):
    server_class = WatchingServer


if __name__ == "__main__":
    WatchingCommandLineInterface.entrypoint()
