"""RecentRoutes: where this router sent recent prompts, ahead of the workers' KV events."""

from __future__ import annotations

from types import SimpleNamespace

from pdserve.router.recent_routes import RecentRoutes, predicted_cached


def test_a_routed_prompt_matches_its_prefixes_on_that_worker_until_it_expires():
    recent = RecentRoutes(ttl_s=5.0)
    recent.add([1, 2, 3, 4], "a", now=0.0)
    assert recent.lookup([1, 2, 3, 4, 5, 6], now=1.0) == {"a": 4}  # a longer prompt: its routed prefix
    assert recent.lookup([1, 2, 9], now=1.0) == {"a": 2}  # diverging after two blocks
    assert recent.lookup([7, 2, 3], now=1.0) == {}  # chained keys: nothing past a first miss
    assert recent.lookup([1, 2], now=5.0) == {}  # expired


def test_the_latest_route_of_a_block_wins_and_both_workers_keep_their_depth():
    recent = RecentRoutes(ttl_s=5.0)
    recent.add([1, 2, 3], "a", now=0.0)
    recent.add([1, 2], "b", now=1.0)  # the shared prefix was sent to b since
    assert recent.lookup([1, 2, 3], now=2.0) == {"b": 2, "a": 3}


def test_old_and_excess_keys_are_dropped():
    recent = RecentRoutes(ttl_s=5.0, max_keys=3)
    recent.add([1, 2], "a", now=0.0)
    recent.add([3, 4], "b", now=1.0)
    assert len(recent) == 3 and recent.lookup([1], now=1.0) == {}  # the oldest went first
    recent.add([5], "c", now=10.0)  # past the others' expiry: they go on the next add
    assert len(recent) == 1 and recent.lookup([5], now=10.0) == {"c": 1}


def test_the_predicted_hit_is_per_worker_the_larger_of_the_index_and_each_roles_routes_in_tokens():
    """What the router's dispatcher and the simulator both route on (``predicted_cached``)."""
    index = SimpleNamespace(lookup=lambda keys: {"a": 1, "b": 3})  # the global index's match, in blocks
    decode, prefill = RecentRoutes(ttl_s=5.0), RecentRoutes(ttl_s=5.0)
    decode.add([1, 2], "a", now=0.0)
    prefill.add([1, 2, 3], "c", now=0.0)
    keys = [1, 2, 3, 4]
    assert predicted_cached(keys, index, [decode, prefill], 1.0, 16) == {"a": 32, "b": 48, "c": 48}
    assert predicted_cached(keys, None, [decode], 1.0, 16) == {"a": 32}  # no index consulted
    assert predicted_cached(keys, index, [], 1.0, 4) == {"a": 4, "b": 12}
