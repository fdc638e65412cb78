"""The shard-lease policy (no Redis): fair shares, preferences, rescues, balancing."""

from __future__ import annotations

from workers.detokenizer.leases import Plan, fair_share, plan


def holders(*owners: str | None) -> dict[int, str | None]:
    return dict(enumerate(owners))


def test_fair_share() -> None:
    assert [fair_share(4, n) for n in (0, 1, 2, 3, 4, 5)] == [4, 4, 2, 2, 1, 1]


def test_a_lone_detokenizer_takes_every_shard_preferred_first() -> None:
    step = plan("a", holders(None, None, None), {"a"}, [2], set(), set())
    assert step == Plan(take=[2, 0, 1], rescue=[], give=[])


def test_it_takes_free_shards_up_to_its_share_only() -> None:
    step = plan("b", holders("a", None, None, None), {"a", "b"}, [3], set(), set())
    assert step == Plan(take=[3, 1], rescue=[], give=[])


def test_a_shard_free_for_two_ticks_is_rescued_above_the_share() -> None:
    # "a" is dead: its lease expired, its heartbeat not yet, so b's share is still 1.
    now_free = holders(None, "b")
    assert plan("b", now_free, {"a", "b"}, [], set(), set()) == Plan([], [], [])
    assert plan("b", now_free, {"a", "b"}, [], {0}, set()) == Plan([], [0], [])


def test_shards_above_the_share_go_to_a_peer_that_holds_fewer() -> None:
    step = plan("a", holders("a", "a", "a", "a"), {"a", "b"}, [1], set(), set())
    assert step == Plan(take=[], rescue=[], give=[3, 2])  # the preferred one is kept


def test_no_shard_is_given_up_without_a_peer_below_its_share() -> None:
    assert plan("a", holders("a", "a", "b"), {"a", "b"}, [], set(), set()).give == []
    # Three live detokenizers, two shards: the third waits as a standby.
    assert plan("a", holders("a", "b"), {"a", "b", "c"}, [], set(), set()).give == []


def test_nothing_is_given_up_while_a_rescue_is_pinned() -> None:
    assert plan("b", holders("b", "b"), {"a", "b"}, [], set(), pinned={0}).give == []
    assert plan("b", holders("b", "b"), {"a", "b"}, [], set(), pinned=set()).give == [1]


def test_shards_held_by_others_are_left_alone() -> None:
    step = plan("c", holders("a", "b"), {"a", "b", "c"}, [0, 1], {0, 1}, set())
    assert step == Plan([], [], [])


def test_preferences_outside_the_shards_are_ignored() -> None:
    assert plan("a", holders(None, None), {"a"}, [7, 1], set(), set()).take == [1, 0]
