"""Where this router sent each recent prompt, until the workers' own KV events say so.

Workers publish their KV events with their heartbeats (``heartbeat_s``, 1 s by default), so the
global prefix index learns a prompt's blocks a second or so after the worker stored them: a
conversation's next turn, or a burst of requests on one system prompt, would be routed before
the index knows. This router remembers, for ``ttl_s``, which worker it sent each block of each
prompt to (as SGLang's router inserts a request's prefix into its tree when it routes it); a
lookup takes, per worker, the larger of the index's match and this one. Past ``ttl_s`` the
index, fed by the events, is the only word: an entry here can be wrong only for that long (the
worker evicted the blocks, or the request failed). Without a state store (no events at all)
this is the only prefix knowledge the router has.

Keys are the prefix index's (``prefix_index.prompt_keys``): each names its whole prefix, so a
key routed to a worker means that worker was sent every block before it too.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class RecentRoutes:
    def __init__(self, ttl_s: float = 5.0, max_keys: int = 200_000):
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        self._keys: OrderedDict[int, tuple[str, float]] = OrderedDict()  # key -> (worker, expiry), oldest first

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, keys: Sequence[int], worker_id: str, now: float) -> None:
        """The prompt with these keys was sent to ``worker_id`` at ``now``."""
        expiry = now + self.ttl_s
        entries = self._keys
        for key in keys:
            entries[key] = (worker_id, expiry)
            entries.move_to_end(key)
        while entries and (len(entries) > self.max_keys or next(iter(entries.values()))[1] <= now):
            entries.popitem(last=False)

    def lookup(self, keys: Sequence[int], now: float) -> dict[str, int]:
        """Each worker's matched prefix in blocks, from the routes still fresh; O(len(keys))."""
        matched: dict[str, int] = {}
        entries = self._keys
        for depth, key in enumerate(keys, 1):
            entry = entries.get(key)
            if entry is None:
                break  # no later key can have been routed without this one
            if entry[1] > now:
                matched[entry[0]] = depth
        return matched


def predicted_cached(keys: Sequence[int], index, recents: Iterable[RecentRoutes], now: float,
                     block_size: int) -> dict[str, int]:
    """Each worker's predicted prefix hit in tokens for a prompt's keys: per worker, the larger of the global
    prefix index's match (``index``; None: not consulted) and the recent routes' (``recents``, each role's)."""
    matched = index.lookup(keys) if index is not None else {}
    for recent in recents:
        for w, blocks in recent.lookup(keys, now).items():
            matched[w] = max(blocks, matched.get(w, 0))
    return {w: blocks * block_size for w, blocks in matched.items()}
