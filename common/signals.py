"""Graceful stop for the actor and learner processes."""

from __future__ import annotations

import signal
import threading


def stop_on_signals() -> threading.Event:
    """An event set by SIGTERM or SIGINT, so a main loop can finish its step and close cleanly."""
    stop = threading.Event()

    def handler(signum, frame):
        stop.set()
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop
