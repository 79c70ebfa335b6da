"""The traffic log's writer on its own (no server): the row format read_logged reads back, rotation
by size and by age (a fake clock), only whole files visible to a retrain, reproducible sampling,
a full queue dropping and counting, a write error (a full disk) counted, said once, survived, and
the open file of a killed server handed over by the next one, cut to its last whole row."""

import errno
import io
import json
import os
import time

import pytest

from decoding.serve import traffic_log as T
from training.logged import logged_files, read_logged


class Tok:
    """Just what Rows uses: a BOS the encoder adds, a template that writes it too."""

    bos_token, bos_token_id = "<s>", 1

    def encode(self, text):
        return [1] + [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join("<s>" if i == 1 else chr(i) for i in ids)

    def apply_chat_template(self, msgs, add_generation_prompt=True, tokenize=False):
        return "<s>" + "".join(f"[{m['role']}] {m['content']}\n" for m in msgs) + "[assistant]"


def open_log(tmp_path, clock=None, err=None, **kw) -> T.TrafficLog:
    return T.TrafficLog(T.LogConfig(str(tmp_path / "logged"), **kw), clock=clock or time.time, tick_s=0.01,
                        err=err or io.StringIO())


def until(cond, timeout=10.0):
    end = time.time() + timeout
    while not cond():
        assert time.time() < end, "timed out"
        time.sleep(0.01)


def test_rows_read_back_as_the_collect_should_feed_them(tmp_path):
    rows = T.Rows(Tok(), clock=lambda: 0.0)
    one = rows.chat([{"role": "user", "content": "hello there"}])
    assert one == {"id": T.row_id("hello there", False), "kind": "chat", "prompt": "hello there", "raw": False,
                   "time": "1970-01-01T00:00:00Z", "messages": [{"role": "user", "content": "hello there"}]}
    convo = rows.chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert convo["raw"] and convo["prompt"] == "[system] be brief\n[user] hi\n[assistant]"  # no second BOS
    text = rows.completion("w1 w2")
    ids = rows.completion([1, ord("a"), ord("b")])
    assert (text["raw"], text["prompt"], ids["prompt"]) == (True, "w1 w2", "ab")
    log = open_log(tmp_path).start()
    for r in (one, convo, text, ids, one):
        log.put(r)
    log.close()
    got = {p.id: p for p in read_logged(tmp_path / "logged")}
    assert len(got) == 4  # the repeated prompt counts once
    assert got[one["id"]].text == "hello there" and not got[one["id"]].raw
    assert got[convo["id"]].raw and got[text["id"]].kind == "completion"
    assert log.logged == 5 and log.dropped == {"queue_full": 0, "write_error": 0, "bad_row": 0}


def test_rotation_by_size_hands_over_whole_files_only(tmp_path):
    log = open_log(tmp_path, rotate_mb=300 / 2**20).start()
    row = {"prompt": "x" * 100}
    log.put(row)
    log.wait_idle()
    assert logged_files(tmp_path / "logged") == []  # the open file is never visible
    assert [p.name.startswith(".traffic-") and p.name.endswith(".jsonl.part")
            for p in (tmp_path / "logged").iterdir()] == [True]
    for _ in range(5):
        log.put(row)
        log.wait_idle()  # one row a batch: rotation is checked after each
    files = logged_files(tmp_path / "logged")
    assert len(files) == 2 and all(f.name.startswith("traffic-") for f in files)
    assert all(len(f.read_text().splitlines()) == 3 for f in files)
    log.close()
    assert not list((tmp_path / "logged").glob(".*"))  # shutdown: nothing left open, no empty file
    assert len(logged_files(tmp_path / "logged")) == 2
    assert all(oct(f.stat().st_mode & 0o777) == "0o600" for f in files)


def test_rotation_by_age_with_a_fake_clock(tmp_path):
    now = [1_000_000.0]
    log = open_log(tmp_path, clock=lambda: now[0], rotate_minutes=1).start()
    log.put({"prompt": "a"})
    log.wait_idle()
    now[0] += 59
    time.sleep(0.1)  # ten writer ticks: not due yet
    assert logged_files(tmp_path / "logged") == []
    now[0] += 2
    until(lambda: logged_files(tmp_path / "logged"))  # a quiet server hands its file over too
    (f,) = logged_files(tmp_path / "logged")
    assert f.name.startswith("traffic-19700112T134640Z-") and f.read_text() == '{"prompt": "a"}\n'
    log.put({"prompt": "b"})
    log.close()
    assert len(logged_files(tmp_path / "logged")) == 2


def test_sampling_is_a_seeded_draw_per_request(tmp_path):
    draws = [open_log(tmp_path, sample_rate=0.3, seed=7) for _ in range(2)]
    a, b = ([log.sampled() for _ in range(2000)] for log in draws)
    assert a == b and 500 < sum(a) < 700
    assert all(open_log(tmp_path).sampled() for _ in range(100))
    with pytest.raises(ValueError, match="sample-rate"):
        open_log(tmp_path, sample_rate=0.0)


def test_a_full_queue_drops_and_counts(tmp_path):
    log = open_log(tmp_path, queue_size=2)  # not started: nothing takes rows off the queue
    for i in range(5):
        log.put({"prompt": str(i)})
    assert log.dropped["queue_full"] == 3
    log.start()
    log.close()
    assert [p.text for p in read_logged(tmp_path / "logged")] == ["0", "1"] and log.logged == 2


def test_a_write_error_is_counted_said_once_and_survived(tmp_path, monkeypatch):
    err = io.StringIO()
    log = open_log(tmp_path, err=err).start()
    log.put({"prompt": "kept"})
    log.wait_idle()
    real, calls = os.write, []

    def full(fd, data):  # half a row lands, then the disk is full
        calls.append(1)
        if len(calls) == 1:
            return real(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(T.os, "write", full)
    log.put({"prompt": "lost 1"})
    log.wait_idle()
    log.put({"prompt": "lost 2"})
    log.wait_idle()
    monkeypatch.setattr(T.os, "write", real)
    log.put({"prompt": "after"})
    log.close()
    assert log.dropped["write_error"] == 2 and log.logged == 2
    assert err.getvalue().count("\n") == 1 and "No space left on device" in err.getvalue()
    (f,) = logged_files(tmp_path / "logged")
    assert [json.loads(x)["prompt"] for x in f.read_text().splitlines()] == ["kept", "after"]  # no half row


def test_a_killed_servers_open_file_is_handed_over_whole(tmp_path):
    folder = tmp_path / "logged"
    folder.mkdir()
    dead = folder / f".traffic-20260101T000000Z-{2**22 + 1}-0003.jsonl.part"  # beyond any pid
    dead.write_bytes(b'{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c')
    live = folder / f".traffic-20260101T000000Z-{os.getppid()}-0000.jsonl.part"
    live.write_bytes(b'{"prompt": "still written"}\n')
    empty = folder / f".traffic-20260101T000000Z-{2**22 + 2}-0000.jsonl.part"
    empty.write_bytes(b'{"prompt": "cut')
    log = open_log(tmp_path).start()
    log.close()
    (f,) = logged_files(folder)
    assert f.name == f"traffic-20260101T000000Z-{2**22 + 1}-0003.jsonl"
    assert sorted(p.text for p in read_logged(folder)) == ["a", "b"]
    assert live.exists() and not empty.exists()
