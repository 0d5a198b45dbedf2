"""Barge-in's pure parts: the playback model, the settings table, the derived hops."""

from __future__ import annotations

import pytest

from cancelbench.bargein import BargeinError, heard_ms, outcome_columns, parse_settings, play, trial_of
from cancelbench.schema import derive, empty_row

MS = 1_000_000
RATE = 1000  # one sample per ms keeps the arithmetic readable


def test_a_sample_is_heard_one_buffer_after_it_was_handed_over_and_in_real_time():
    pb = play([(0, 50), (10 * MS, 50)], RATE, buffer_ms=40, t_stop_ns=None)
    # the second chunk came before the first had played: it follows without a gap
    assert pb.heard == ((40 * MS, 140 * MS),)
    assert (pb.samples_handed, pb.samples_heard) == (100, 100)


def test_an_underrun_leaves_a_gap_and_a_late_chunk_waits_for_its_own_buffer():
    pb = play([(0, 10), (100 * MS, 10)], RATE, buffer_ms=40, t_stop_ns=None)
    assert pb.heard == ((40 * MS, 50 * MS), (140 * MS, 150 * MS))


def test_a_stop_keeps_what_the_device_holds_and_drops_the_rest():
    # 1000 ms of audio handed over at once; the engine stops at 100 ms: the device holds the next
    # 40 ms (buffer), so playback ends at 140 ms and nothing handed over after the stop plays
    pb = play([(0, 1000), (120 * MS, 500)], RATE, buffer_ms=40, t_stop_ns=100 * MS)
    assert pb.heard == ((40 * MS, 140 * MS),)
    assert pb.samples_heard == 100 and pb.samples_handed == 1500
    cols = outcome_columns(pb, t_onset_ns=60 * MS, t_terminal_ns=100 * MS)
    assert cols["t_silence_ns"] == 140 * MS  # the device's last sample, after the stop
    assert cols["audio_after_onset_ms"] == pytest.approx(80.0)
    assert heard_ms(pb, 0) == pytest.approx(100.0)


def test_silence_is_the_engine_stop_when_nothing_was_playing():
    pb = play([], RATE, buffer_ms=200, t_stop_ns=30 * MS)
    cols = outcome_columns(pb, t_onset_ns=10 * MS, t_terminal_ns=30 * MS)
    assert cols["t_silence_ns"] == 30 * MS and cols["audio_after_onset_ms"] == 0


def test_a_bigger_buffer_plays_longer_after_the_same_stop():
    chunks = [(0, 5000)]
    small = play(chunks, RATE, buffer_ms=40, t_stop_ns=500 * MS)
    big = play(chunks, RATE, buffer_ms=200, t_stop_ns=500 * MS)
    assert small.t_last_heard_ns == 540 * MS and big.t_last_heard_ns == 700 * MS


def test_the_hops_add_up_to_onset_to_silence():
    row = empty_row()
    row.update(trial_kind="cancel", bargein_detector="silero", t_onset_ns=100 * MS, t_detected_ns=170 * MS,
               t_issued_ns=171 * MS, t_received_ns=172 * MS, t_terminal_ns=200 * MS, t_silence_ns=260 * MS,
               onset_sample=1600, detected_sample=2720, detector_fired=True)
    derive(row)
    hops = row["detect_ms"] + row["issue_ms"] + row["deliver_ms"] + row["latency_ms"] + row["drain_ms"]
    assert hops == pytest.approx(row["onset_to_silence_ms"]) and row["onset_to_silence_ms"] == 160
    assert row["detection_error_ms"] == pytest.approx(70.0) and row["false_barge_in"] is False


def test_false_barge_ins_are_noise_only_fires_and_fires_before_the_speech():
    row = empty_row()
    row.update(trial_kind="cancel", bargein_detector="silero", detector_fired=True, detected_sample=900)
    assert derive(dict(row))["false_barge_in"] is True  # no onset: a noise-only clip
    row.update(onset_sample=1600, t_onset_ns=100 * MS)
    assert derive(dict(row))["false_barge_in"] is True  # fired on sample 900, speech starts at 1600
    row.update(detector_fired=False, detected_sample=None)
    assert derive(dict(row))["false_barge_in"] is False


@pytest.mark.parametrize("table, said", [
    ({"detector": "vosk"}, "detector must be one of"),
    ({"chunk_ms": 5}, "chunk_ms must be in [10, 32]"),
    ({"playback_buffer_ms": -1}, "playback_buffer_ms must be a number"),
    ({"threshold": True}, "threshold must be a number"),
    ({"buffer": 40}, "unknown key(s) buffer"),
    ([], "must be a table"),
])
def test_bad_settings_are_one_line(table, said):
    with pytest.raises(BargeinError, match=None) as err:
        parse_settings(table, "workload[0].bargein")
    assert said in str(err.value) and "\n" not in str(err.value)


def test_detector_defaults_follow_the_kind():
    assert parse_settings({"detector": "webrtc"}, "w").webrtc_mode == 2
    s = parse_settings({}, "w")
    assert (s.detector, s.frame_ms, s.threshold, s.webrtc_mode) == ("silero", 32, 0.5, None)


def test_clips_go_round_robin_over_the_set_within_a_cell():
    from cancelbench.bargein import ClipEntry
    entries = [ClipEntry(i, f"c{i}", None, 10.0, None) for i in range(3)]
    s = parse_settings({}, "w")
    picked = [trial_of(s, entries, f"d.w.graph_eval.detector.{k:04d}", 0).clip.index for k in range(6)]
    assert picked == [0, 1, 2, 0, 1, 2]
    # the noise seed depends on the trial and the sweep's seed, so a resumed trial streams the same
    assert trial_of(s, entries, "a.0001", 1).noise_seed == trial_of(s, entries, "a.0001", 1).noise_seed
    assert trial_of(s, entries, "a.0001", 1).noise_seed != trial_of(s, entries, "a.0001", 2).noise_seed


def test_aim_cancel_leads_the_onset_by_the_median_of_recent_detections():
    import collections

    from cancelbench.orchestrator.bargein_config import trial_bargein
    s = parse_settings({"aim": "cancel", "clips": "bargein-ci"}, "w")
    seen = collections.deque([90 * MS, 50 * MS, 70 * MS], maxlen=64)  # the driver keeps bounded deques
    assert trial_bargein(s, "c.0000", "detector", 0, seen).onset_lead_ms == 70.0
    assert trial_bargein(s, "c.0000", "detector", 0, collections.deque()).onset_lead_ms == 64 + 20
    onset = parse_settings({"clips": "bargein-ci"}, "w")
    assert trial_bargein(onset, "c.0000", "detector", 0, seen).onset_lead_ms == 0.0
    assert trial_bargein(onset, "c.0000", "agent", 0, seen) is None
