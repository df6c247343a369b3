"""A bounded outgoing queue for one stream (a worker session or a tap).

It lives on the daemon's event loop, so it needs no locks. A mailbox that is full is never
skipped silently: the caller cuts the stream off with a reason instead.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


async def _wait_with_timeout(event: asyncio.Event, timeout_s: float) -> None:
    # asyncio.timeout arms one timer; wait_for would also create a task per call, and this
    # wait runs once per relayed step on every idle session.
    async with asyncio.timeout(timeout_s):
        await event.wait()


class MailboxClosed(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Mailbox(Generic[T]):
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: deque[T] = deque()
        self._ready = asyncio.Event()
        self._closed: MailboxClosed | None = None
        self.last_step_id = 0
        self.delivered = 0

    def __len__(self) -> int:
        return len(self._items)

    @property
    def closed(self) -> bool:
        return self._closed is not None

    def offer(self, item: T) -> bool:
        """Queues `item`; False when full (the caller must cut the stream off)."""
        if self._closed is not None:
            return True
        if len(self._items) >= self.capacity:
            return False
        self._items.append(item)
        self._ready.set()
        return True

    def close(self, code: str = "OK", message: str = "", *, discard: bool = False) -> None:
        """Ends the stream after what is queued (or at once with discard=True)."""
        if self._closed is not None:
            return
        if discard:
            self._items.clear()
        self._closed = MailboxClosed(code, message)
        self._ready.set()

    async def get(self, timeout_s: float | None = None) -> T | None:
        """The next item; None when `timeout_s` passes with nothing queued."""
        while True:
            if self._items:
                self.delivered += 1
                return self._items.popleft()
            if self._closed is not None:
                raise self._closed
            self._ready.clear()
            if timeout_s is None:
                await self._ready.wait()
                continue
            try:
                await _wait_with_timeout(self._ready, timeout_s)
            except TimeoutError:
                return None
