"""The prefix-aware router's rule, without Ray: the longest run of held blocks wins, reports replace reports,
the router's own records expire, loads too far apart fall back to power of two choices."""

from __future__ import annotations

from aioengine.ray_serve.prefix_index import PrefixIndex, choose


def test_the_longest_leading_run_wins_and_a_gap_ends_it():
    index = PrefixIndex()
    index.report("a", {"block_hashes": [1, 2], "load": 0})
    index.report("b", {"block_hashes": [1, 2, 3, 5], "load": 0})  # 4 missing: 5 does not count
    assert index.matched("a", [1, 2, 3, 4, 5], 0.0) == 2
    assert index.matched("b", [1, 2, 3, 4, 5], 0.0) == 3
    assert index.matched("c", [1, 2, 3], 0.0) == 0
    assert index.matched("b", [2, 3], 0.0) == 2  # a run is scored from the request's first block
    assert choose(index, ["a", "b"], {"a": 0, "b": 0}, [1, 2, 3, 4], 0.0) == ("prefix_hit", ["b"])
    # 3 of 7 blocks is under half the prompt: a shared opening alone does not pull a request along
    assert choose(index, ["a", "b"], {"a": 0, "b": 0}, [1, 2, 3, 4, 6, 7, 8], 0.0) == ("miss", ["a"])
    assert choose(index, ["a", "b"], {}, [1, 2, 3, 4, 6, 7, 8], 0.0, min_match=0.4)[0] == "prefix_hit"
    assert choose(index, ["a", "b"], {"a": 0, "b": 0}, [9, 1, 2], 0.0) == ("miss", ["a"])  # holds fewer
    assert choose(index, ["a", "b"], {"a": 0, "b": 0}, [], 0.0) == ("miss", [])  # nothing to score


def test_a_report_replaces_the_last_one():
    index = PrefixIndex()
    index.report("a", {"block_hashes": [1, 2, 3]})
    index.report("a", {"block_hashes": [1]})  # the rest was evicted
    assert index.matched("a", [1, 2, 3], 0.0) == 1


def test_records_count_until_their_ttl_and_a_forgotten_replica_holds_nothing():
    index = PrefixIndex(record_ttl_s=10.0)
    index.record("a", [1, 2, 3], now=100.0)
    assert index.matched("a", [1, 2, 3, 4], 105.0) == 3
    assert index.matched("b", [1, 2, 3, 4], 105.0) == 0
    assert index.matched("a", [1, 2, 3], 111.0) == 0  # expired
    index.report("a", {"block_hashes": [1]})
    index.record("a", [1, 2], now=120.0)
    assert index.matched("a", [1, 2, 3], 125.0) == 2  # a report and a record together
    index.forget("a")
    assert index.matched("a", [1, 2], 125.0) == 0


def test_records_are_bounded_least_recently_sent_first():
    index = PrefixIndex(max_recorded=3)
    index.record("a", [1, 2, 3], 0.0)
    index.record("b", [1], 0.0)  # 1 is the most recent now
    index.record("a", [4], 0.0)
    assert list(index.recorded) == [3, 1, 4]
    assert index.matched("a", [1], 0.0) == 1 and index.matched("b", [1], 0.0) == 1


def test_ties_go_to_the_less_loaded_and_loads_far_apart_fall_back():
    index = PrefixIndex()
    for r in ("a", "b"):
        index.report(r, {"block_hashes": [1, 2]})
    assert choose(index, ["a", "b"], {"a": 3, "b": 1}, [1, 2], 0.0) == ("prefix_hit", ["b"])
    # 20 against 0 is past both 16 apart and 1.5 times (the defaults): the prefix is not followed
    index.report("a", {"block_hashes": [1, 2, 3]})
    assert choose(index, ["a", "b"], {"a": 20, "b": 0}, [1, 2, 3], 0.0) == ("load_fallback", [])
    assert choose(index, ["a", "b"], {"a": 16, "b": 0}, [1, 2, 3], 0.0) == ("prefix_hit", ["a"])
    assert choose(index, ["a", "b"], {"a": 40, "b": 30}, [1, 2, 3], 0.0) == ("prefix_hit", ["a"])  # 1.33x
    assert choose(index, ["a", "b"], {"a": 5, "b": 0}, [1, 2, 3], 0.0, balance_abs=4)[0] == "load_fallback"
    assert choose(index, ["a", "b"], {"a": 20, "b": 0}, [1, 2, 3], 0.0, balance_abs=20)[0] == "prefix_hit"


def test_misses_go_to_the_least_loaded_replica_holding_the_least():
    """New conversations spread over the replicas, each sent where the fewest blocks are held."""
    index = PrefixIndex()
    replicas, loads = ["a", "b", "c"], {"a": 0, "b": 0, "c": 0}
    placed = []
    for c in range(6):
        prompt = [100 * c + i for i in range(4)]
        decision, order = choose(index, replicas, loads, prompt, 0.0)
        assert decision == "miss"
        index.record(order[0], prompt, 0.0)
        placed.append(order[0])
    assert sorted(placed) == ["a", "a", "b", "b", "c", "c"]
    assert choose(index, replicas, {"a": 0, "b": 2, "c": 1}, [7, 8], 0.0) == ("miss", ["a"])  # load first
    index.max_recorded = 4  # the oldest records go, and their replicas' counts with them
    index.record("c", [1000], 0.0)
    assert sum(index.num_recorded.values()) == len(index.recorded) == 4
    index.forget("c")
    assert index.held("c") == 0
