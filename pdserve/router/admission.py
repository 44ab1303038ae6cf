"""The router's admission: a cap on sequences in flight, and bounded queues per service class.

A request holds its sequences (prompts x n) from admission to its end. Past the cap
(``max_concurrent_requests``) it waits in its class's queue, up to ``queue_size`` requests in all
and ``queue_timeout_s`` each, and is let in as sequences free up: ``priority`` before ``default``
before ``flex``, first come first served within a class. A full queue sheds from the bottom: a
request arriving for a higher class pushes out the newest waiting request of the lowest class
below it (that one gets the 429); one that outranks nobody gets the 429 itself. ``queue_size`` 0
answers 429 at once, as before queues existed. A request alone is always admitted, however many
sequences it has (``max_batch`` bounds that).

    class 0 (priority) |r7|r9|        <- admitted first when sequences free up
    class 1 (default)  |r2|r5|r8|
    class 2 (flex)     |r1|r4|        <- shed from the right when a higher class finds the queue full
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

TIER_CLASS = {"priority": 0, "default": 1, "flex": 2}  # "auto" is served as "default"


class Refused(Exception):
    """Not admitted (queue full, shed, or waited too long): the 429's message."""


@dataclass
class _Waiter:
    sequences: int
    klass: int
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Admission:
    def __init__(self, max_sequences: int, queue_size: int = 0, queue_timeout_s: float = 30.0):
        self.max_sequences = max_sequences
        self.queue_size = queue_size
        self.queue_timeout_s = queue_timeout_s
        self.in_flight = 0  # sequences admitted and not released
        self.queues: list[deque[_Waiter]] = [deque() for _ in TIER_CLASS]
        self.shed = 0  # requests pushed out of a full queue by a higher class

    @property
    def waiting(self) -> int:
        return sum(len(q) for q in self.queues)

    def _fits(self, sequences: int) -> bool:
        return not self.in_flight or self.in_flight + sequences <= self.max_sequences

    async def acquire(self, sequences: int, klass: int) -> None:
        """Admit ``sequences`` of class ``klass`` now, or after waiting in its queue; raises Refused."""
        if self._fits(sequences) and not any(len(q) for q in self.queues[:klass + 1]):
            self.in_flight += sequences
            return
        if not self.queue_size:
            raise Refused(f"too many sequences in flight ({self.in_flight}, and this request's {sequences}; the "
                          f"limit is {self.max_sequences})")
        if self.waiting >= self.queue_size and not self._shed_below(klass):
            raise Refused(f"the router is at its limit of {self.max_sequences} sequences and its queue of "
                          f"{self.queue_size} requests is full")
        waiter = _Waiter(sequences, klass)
        self.queues[klass].append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), self.queue_timeout_s)
        except TimeoutError:
            if waiter.future.done() and waiter.future.exception() is None:
                return  # admitted as the wait ran out: keep it
            self._forget(waiter)
            raise Refused(f"waited {self.queue_timeout_s:g} s in the queue for class {klass} without room") from None
        except asyncio.CancelledError:
            if waiter.future.done() and waiter.future.exception() is None:
                self.release(sequences)  # admitted, but the client left first
            self._forget(waiter)
            raise

    def release(self, sequences: int) -> None:
        self.in_flight -= sequences
        self._wake()

    def _wake(self) -> None:
        for queue in self.queues:
            while queue and self._fits(queue[0].sequences):
                waiter = queue.popleft()
                if waiter.future.done():
                    continue
                self.in_flight += waiter.sequences
                waiter.future.set_result(None)
            if queue:
                return  # a higher class waits for room: nothing of a lower class goes ahead of it

    def _shed_below(self, klass: int) -> bool:
        """Push the newest waiting request of the lowest class below ``klass`` out; False if none."""
        for lower in range(len(self.queues) - 1, klass, -1):
            if self.queues[lower]:
                victim = self.queues[lower].pop()
                self.shed += 1
                victim.future.set_exception(Refused(f"shed from the queue for a request of a higher service class "
                                                    f"(the router is at its limit of {self.max_sequences} "
                                                    f"sequences)"))
                return True
        return False

    def _forget(self, waiter: _Waiter) -> None:
        try:
            self.queues[waiter.klass].remove(waiter)
        except ValueError:
            pass
