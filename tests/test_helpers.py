"""The test helpers that judge results: they must tell a leak from a one-time step."""

from helpers import leak_kb_per_cycle


def test_a_one_time_step_is_not_a_leak():
    rss = [800_000] * 12 + [807_000] * 18  # the CI trace: flat, one ~7 MB step mid-run, flat
    assert leak_kb_per_cycle(rss) == 0


def test_a_steady_leak_is_measured():
    rss = [800_000 + 300 * i + (9_000 if i >= 17 else 0) for i in range(30)]  # a one-time step on top
    assert leak_kb_per_cycle(rss) == 300
