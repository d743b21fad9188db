"""Client side of the duplex gateway: `DuplexClient`, the `duplex talk` CLI, examples, and the web demo.

Imports neither `gateway` nor `engine`. `WEB_ROOT` is the static folder the gateway serves at `/`.
"""

from pathlib import Path

from clients.client import DuplexClient
from clients.connection import DEFAULT_SESSION, DuplexError
from clients.inbox import SessionEndedError
from clients.response import ResponseHandle
from clients.timing import EventCollector

WEB_ROOT = Path(__file__).resolve().parent / "web"

__all__ = ["DEFAULT_SESSION", "WEB_ROOT", "DuplexClient", "DuplexError", "EventCollector", "ResponseHandle",
           "SessionEndedError"]
