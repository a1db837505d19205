"""The --dp dispatcher (ext/serving/dispatch.py): longest indexed prefix wins, new prefixes spread
over the replicas, uneven loads fall back to the least loaded, round robin ignores both."""

from minisgl.ext.serving.dispatch import Dispatcher, block_hashes

PAGE = 4
A = list(range(100, 116))  # four pages
B = list(range(200, 216))


def send(d: Dispatcher, uid: int, ids: list[int]) -> int:
    replica = d.choose(ids)
    d.sent(uid, replica, ids)
    return replica


def test_block_hashes_cover_the_whole_prefix() -> None:
    assert len(block_hashes(A + [1, 2], PAGE)) == 4  # partial pages are not indexed
    assert block_hashes(A, PAGE)[:2] == block_hashes(A[:8] + B, PAGE)[:2]
    assert block_hashes(A, PAGE)[1] != block_hashes(B[:4] + A[4:], PAGE)[1]  # not per block


def test_prefix_stays_on_its_replica_and_new_ones_spread() -> None:
    d = Dispatcher(2, PAGE, "prefix", load_threshold=8)
    first_a, first_b = send(d, 0, A + [1]), send(d, 1, B + [1])
    assert first_a != first_b  # a new prefix goes to the other (equally loaded) replica
    assert [send(d, 2 + i, A + [i]) for i in range(4)] == [first_a] * 4
    assert send(d, 9, B[:8] + [7, 7, 7, 7]) == first_b  # a shorter shared prefix counts too
    assert d.loads[first_a] == 5 and d.loads[first_b] == 2
    for uid in (0, 2, 3, 4, 5):
        d.done(uid)
    d.done(5)  # twice, or unknown: nothing
    assert d.loads[first_a] == 0 and d.replica_of(2) is None and d.replica_of(1) == first_b


def test_uneven_loads_go_to_the_least_loaded() -> None:
    d = Dispatcher(2, PAGE, "prefix", load_threshold=2)
    home = send(d, 0, A)
    assert [send(d, i, A) for i in (1, 2)] == [home, home]  # loads 3 vs 0: over the threshold
    assert send(d, 3, A) == 1 - home
    d.done(1)
    d.done(2)
    assert send(d, 4, A) == home  # even again: the prefix wins


def test_round_robin_ignores_prefixes() -> None:
    d = Dispatcher(3, PAGE, "round_robin", load_threshold=0)
    assert [send(d, i, A) for i in range(6)] == [0, 1, 2, 0, 1, 2]
