"""Barge-in clips and the microphone mixer (issue 28): the committed clips match their
lock (a changed byte or a drifted onset label is caught), the mixer is reproducible
byte for byte whatever the chunking, a late onset never rewrites produced samples
and lands on the exact sample asked, and the levels are what was asked, measured
on the output."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from cancelbench.datasets import bargein_clips as B
from cancelbench.datasets.bargein_mic import REFERENCE_SPEECH_DBFS, MicStream, mic_stream
from cancelbench.datasets.locks import LockError


def _stream(user="hold-on", echo="assistant-us", snr=10.0, echo_db=-20.0, noise="pink", seed=7) -> MicStream:
    return MicStream(user and B.load_clip(user), echo and B.load_clip(echo), snr_db=snr,
                     echo_level_db=echo_db if echo else None, noise=noise, seed=seed)


def _chunked(s: MicStream, total: int, sizes: list[int], start: int = 0) -> np.ndarray:
    """Samples start .. total - 1, asked for in chunks of the given sizes, in turn."""
    out, i = [], 0
    while start < total:
        n = min(sizes[i % len(sizes)], total - start)
        out.append(s.chunk(start, n))
        start, i = start + n, i + 1
    return np.concatenate(out)


# ----------------------------------------------------------------------------- clips and lock

def test_committed_clips_match_their_lock_with_labelled_onsets():
    clips = B.verify_bargein_clips()
    assert set(clips) == set(B.CLIPS) and 4 <= len(B.USER_CLIPS) <= 6 and 1 <= len(B.ASSISTANT_CLIPS) <= 2
    for clip_id, clip in clips.items():
        if clip_id in B.USER_CLIPS:
            assert clip.onset == B.LEAD_SAMPLES == B.speech_onset(clip.pcm)
            assert 0.5 < len(clip.pcm) / B.RATE < 3.0
        else:
            assert clip.onset is None and 6.0 <= len(clip.pcm) / B.RATE <= 10.0
    assert sum(p.stat().st_size for p in B.BARGEIN_DIR.glob("*.wav")) < 1_500_000
    assert {p.stem for p in B.BARGEIN_DIR.glob("*.wav")} == set(B.CLIPS)


@pytest.fixture
def copied(tmp_path):
    shutil.copytree(B.BARGEIN_DIR, tmp_path / "clips")
    shutil.copy(B.BARGEIN_LOCK, tmp_path / "lock.json")
    yield tmp_path / "clips", tmp_path / "lock.json"
    B.load_clip.cache_clear()


def test_a_changed_byte_is_caught(copied):
    clips, lock = copied
    B.verify_bargein_clips(clips, lock)  # the copy verifies
    path = clips / "wait-stop.wav"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit of one sample, same size
    path.write_bytes(bytes(data))
    with pytest.raises(LockError, match="wait-stop.wav: sha256 .* does not match lock"):
        B.verify_bargein_clips(clips, lock)


def test_an_onset_label_that_drifted_from_the_bytes_is_caught(copied):
    clips, lock = copied
    payload = json.loads(lock.read_text())
    payload["files"]["hold-on.wav"]["onset_sample"] = B.LEAD_SAMPLES + B.FRAME
    lock.write_text(json.dumps(payload))
    with pytest.raises(LockError, match="onset_sample of hold-on.wav is 1760, but the clip's onset .* is 1600"):
        B.verify_bargein_clips(clips, lock)


def test_onset_is_the_first_frame_over_a_tenth_of_the_peak_frame():
    x = np.zeros(B.FRAME * 20)
    x[B.FRAME * 5 + 3:B.FRAME * 6] = 0.05  # a frame at RMS ~0.05 (< 0.1 x 1.0 peak frame)
    x[B.FRAME * 7 + 100:B.FRAME * 8] = 0.5  # frame 7: RMS 0.5 * sqrt(60/160) = 0.31 > 0.1
    x[B.FRAME * 9:B.FRAME * 10] = 1.0  # the peak frame
    assert B.speech_onset(x) == 7 * B.FRAME
    with pytest.raises(ValueError, match="no speech onset"):
        B.speech_onset(np.zeros(B.FRAME * 3))


def test_clip_sets_name_known_clips_with_noise_only_entries_at_several_snrs():
    entries = B.clip_set("bargein-v1")
    assert len({e.name for e in entries}) == len(entries)
    assert all(e.user in B.USER_CLIPS for e in entries if e.user is not None)
    assert all(e.echo in B.ASSISTANT_CLIPS for e in entries if e.echo is not None)
    noise_only = [e for e in entries if e.user is None]
    assert len(noise_only) >= 3 and len({e.snr_db for e in noise_only}) >= 2
    assert {e.snr_db for e in entries} >= {20.0, 10.0, 5.0}
    with pytest.raises(ValueError, match="unknown clip set 'nope' \\(sets: bargein-v1"):
        B.clip_set("nope")


# ----------------------------------------------------------------------------- mixer

def test_same_arguments_give_the_same_bytes_whatever_the_chunking():
    total = 3 * B.RATE
    a, b, c = _stream(), _stream(), _stream()
    for s in (a, b, c):
        s.set_onset(B.RATE)
    one = a.chunk(0, total)
    assert np.array_equal(one, _chunked(b, total, [160]))
    assert np.array_equal(one, _chunked(c, total, [512, 7, 333, 1]))
    assert one.dtype == np.int16 and one.tobytes() == _stream_bytes(total)
    assert not np.array_equal(one, _stream(seed=8).chunk(0, total))


def _stream_bytes(total: int) -> bytes:
    s = _stream()
    s.set_onset(B.RATE)
    return s.chunk(0, total).tobytes()


def test_a_late_onset_never_changes_produced_samples():
    total, onset = 3 * B.RATE, 2 * B.RATE
    late, early, quiet = _stream(), _stream(), _stream(user=None)
    early.set_onset(onset)
    first = _chunked(late, B.RATE, [320])  # 1 s streamed before the onset is chosen
    assert late.onset is None and late.produced == B.RATE
    with pytest.raises(ValueError, match="too early: .*earliest onset now: 17600"):
        late.set_onset(B.RATE + B.LEAD_SAMPLES - 1)
    late.set_onset(onset)
    assert np.array_equal(late.chunk(0, B.RATE), first)  # produced samples, asked again: unchanged
    whole = np.concatenate([first, _chunked(late, total, [320], start=B.RATE)])
    assert np.array_equal(whole, early.chunk(0, total))
    assert np.array_equal(whole[:onset - B.LEAD_SAMPLES], quiet.chunk(0, onset - B.LEAD_SAMPLES))
    assert not np.array_equal(whole[onset:], quiet.chunk(onset, total - onset))
    with pytest.raises(ValueError, match="already set"):
        late.set_onset(onset + B.RATE)
    with pytest.raises(ValueError, match="noise-only stream has no onset"):
        quiet.set_onset(onset)


def test_a_cut_lead_in_lands_the_onset_on_the_next_sample_and_keeps_produced_ones():
    total = 2 * B.RATE
    cut, quiet = _stream(), _stream(user=None)
    first = cut.chunk(0, B.RATE)
    with pytest.raises(ValueError, match="too early: samples up to 16000 were produced"):
        cut.set_onset(B.RATE - 1, cut_lead=True)
    cut.set_onset(B.RATE, cut_lead=True)  # the lead-in would start 100 ms back: cut
    assert cut.onset == B.RATE and np.array_equal(cut.chunk(0, B.RATE), first)
    full = _stream()
    full.set_onset(B.RATE)  # the same onset, lead-in kept (nothing produced yet)
    assert np.array_equal(cut.chunk(B.RATE, total - B.RATE), full.chunk(B.RATE, total - B.RATE))
    assert np.array_equal(full.chunk(0, B.RATE - B.LEAD_SAMPLES), quiet.chunk(0, B.RATE - B.LEAD_SAMPLES))


def test_the_onset_lands_on_the_exact_sample():
    clip = B.load_clip("excuse-me")
    for onset in (16000, 16001, 20017):
        s = MicStream(clip, None, snr_db=None, echo_level_db=None)
        s.set_onset(onset)
        out = s.chunk(0, onset - clip.onset + len(clip.pcm) + 100)
        start = onset - clip.onset
        assert not out[:start].any()  # before the clip: digital silence
        scale = 32768.0 * 10 ** (REFERENCE_SPEECH_DBFS / 20) / B.active_rms(clip.pcm)
        want = np.rint((clip.pcm.astype(np.float64) * scale).astype(np.float32)).astype(np.int16)
        assert np.array_equal(out[start:start + len(want)], want) and s.onset == onset
        assert not out[start + len(want):].any()  # after the clip: silence again
        if onset % B.FRAME == 0:
            assert B.speech_onset(out) == onset  # the onset definition, applied to the mic stream


@pytest.mark.parametrize("snr,echo_db,noise", [(20.0, -6.0, "pink"), (10.0, -20.0, "white"), (5.0, -20.0, "pink")])
def test_levels_are_what_was_asked_within_half_a_db(snr, echo_db, noise):
    total, onset = 5 * B.RATE, 2 * B.RATE
    mixed, no_user = _stream(snr=snr, echo_db=echo_db, noise=noise), _stream(None, snr=snr, echo_db=echo_db, noise=noise)
    mixed.set_onset(onset)
    user = mixed.chunk(0, total).astype(np.float64) - no_user.chunk(0, total)  # the user's part of the output
    clip = B.load_clip("hold-on")
    start = onset - clip.onset
    speech_db = B.dbfs(B.active_rms(user[start:start + len(clip.pcm)]))
    noise_db = B.dbfs(float(np.sqrt(np.mean(_stream(None, None, snr=snr, noise=noise).chunk(0, total)
                                             .astype(np.float64) ** 2))))
    echo_clip = B.load_clip("assistant-us")
    echo = _stream(None, snr=None, echo_db=echo_db).chunk(0, len(echo_clip.pcm))
    assert speech_db == pytest.approx(REFERENCE_SPEECH_DBFS, abs=0.5)
    assert speech_db - noise_db == pytest.approx(snr, abs=0.5)
    assert B.dbfs(B.active_rms(echo)) - speech_db == pytest.approx(echo_db, abs=0.5)


def test_the_echo_repeats_and_a_noise_only_entry_streams():
    echo = B.load_clip("assistant-gb")
    s = _stream(None, "assistant-gb", snr=None)
    n = len(echo.pcm)
    assert np.array_equal(s.chunk(0, 1000), s.chunk(n, 1000))  # the echo loops at its length
    assert np.array_equal(s.chunk(n - 500, 1000), np.concatenate([s.chunk(n - 500, 500), s.chunk(0, 500)]))
    entry = next(e for e in B.clip_set("bargein-v1") if e.user is None)
    assert np.array_equal(mic_stream(entry, 3).chunk(0, 4000), mic_stream(entry, 3).chunk(0, 4000))


@pytest.mark.parametrize("kwargs,message", [
    ({"snr_db": 61.0}, r"snr_db must be a number in \[-10, 60\] dB or None, got 61.0"),
    ({"echo_level_db": float("nan")}, r"echo_level_db must be a number in \[-60, 20\] dB or None, got nan"),
    ({"echo_level_db": None}, "echo and echo_level_db go together"),
    ({"noise": "brown"}, "noise must be one of pink, white, got 'brown'"),
    ({"seed": -1}, "seed must be an integer >= 0, got -1"),
])
def test_bad_mixer_arguments_are_one_clear_message(kwargs, message):
    args = {"snr_db": 10.0, "echo_level_db": -20.0, "noise": "pink", "seed": 0, **kwargs}
    with pytest.raises(ValueError, match=message):
        MicStream(B.load_clip("hold-on"), B.load_clip("assistant-us"), **args)
