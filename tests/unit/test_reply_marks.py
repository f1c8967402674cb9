"""The supervisor's side of resume marks (relay/resume.py): what a stream's payloads leave for the
caller, the ids kept, when a stream can go on, and the continuation's body."""

from __future__ import annotations

import json

from mlxd.protocol.process import REPLY_HEADER
from mlxd.supervisor.relay.resume import ReplyMarks

CHUNK = b'data: {"id":"chatcmpl-1","choices":[{"index":0,"delta":{"content":"x: ids 3"}}]}\n\n'


def test_a_mark_is_stripped_and_its_ids_kept() -> None:
    marks = ReplyMarks()
    marks.head({REPLY_HEADER.lower(): "chatcmpl-1 1700000000"})
    assert marks.take(CHUNK + b": ids 0 2 11,12\n\n") == CHUNK
    assert marks.take(CHUNK + CHUNK + b": ids 0 5 13,14,15\n\n") == CHUNK + CHUNK
    assert marks.take(b": ids 0 5 \n\n") == b""  # a write whose tokens made no text yet
    assert marks.ids.tolist() == [11, 12, 13, 14, 15]
    assert marks.segments.tolist() == [2, 3, 0]
    assert marks.started and marks.resumable()


def test_text_that_looks_like_a_mark_inside_an_event_is_left_alone() -> None:
    marks = ReplyMarks()
    assert marks.take(CHUNK) == CHUNK  # ': ids 3' in the content is JSON, not a line of its own
    assert len(marks.ids) == 0


def test_comments_pass_and_the_end_is_seen() -> None:
    marks = ReplyMarks()
    assert marks.take(b": keep-alive\n\n") == b": keep-alive\n\n"
    assert marks.resumable() and not marks.started  # nothing delivered: it is sent again as it was
    assert marks.take(CHUNK + b"data: [DONE]\n\n") == CHUNK + b"data: [DONE]\n\n"
    assert marks.finished and not marks.resumable()


def test_a_drain_cut_error_is_swallowed_and_other_errors_pass() -> None:
    marks = ReplyMarks()
    marks.head({REPLY_HEADER.lower(): "chatcmpl-1 1700000000"})
    marks.take(CHUNK + b": ids 0 1 7\n\n")
    drained = b'data: {"error":{"message":"cut","type":"server_error","param":null,"code":"drain_timeout"}}\n\n'
    assert marks.take(drained) == b""
    assert marks.stopping and marks.resumable()
    other = b'data: {"error":{"message":"bad","type":"server_error","param":null,"code":"generation_failed"}}\n\n'
    assert ReplyMarks().take(other) == other


def test_the_engines_end_cuts_a_reply_short_and_it_can_go_on() -> None:
    """The GPU thread's death (an engine group's rank gone mid-step ends it so) is the engine's end:
    the reply goes on on the next engine, as after a drain's timeout."""
    marks = ReplyMarks()
    marks.head({REPLY_HEADER.lower(): "chatcmpl-1 1700000000"})
    marks.take(CHUNK + b": ids 0 1 7\n\n")
    ended = (b'data: {"error":{"message":"The engine\'s GPU thread stopped.","type":"server_error","param":null,'
             b'"code":"engine_failed"}}\n\n')
    assert marks.take(ended) == b""
    assert marks.stopping and marks.resumable()


def test_events_without_marks_or_marks_that_do_not_add_up_cannot_go_on() -> None:
    unmarked = ReplyMarks()
    unmarked.take(CHUNK)  # an engine that does not mark
    assert not unmarked.resumable()
    wrong = ReplyMarks()
    wrong.head({REPLY_HEADER.lower(): "chatcmpl-1 1700000000"})
    wrong.take(CHUNK + b": ids 0 3 1,2\n\n")  # says 3 in all, names 2
    assert not wrong.resumable()
    for bad in (b": ids zero\n\n", b": ids 0 two 1\n\n", b": ids 0 1 x\n\n"):
        garbled = ReplyMarks()
        assert garbled.take(CHUNK + bad) == CHUNK  # stripped all the same, and the stream can only fail
        assert garbled.broken


def test_n_choices_keep_their_own_ids_and_ends_and_go_on_each_from_its_own() -> None:
    body = json.dumps({"model": "m", "messages": [], "stream": True, "n": 3}).encode()
    marks = ReplyMarks()
    marks.head({REPLY_HEADER.lower(): "chatcmpl-9 1700000001"})
    assert marks.take(CHUNK + b": ids 0 2 5,6\n\n") == CHUNK
    assert marks.take(CHUNK + b": ids 2 1 9\n\n") == CHUNK
    assert marks.take(CHUNK + b": ids 0 3 7 end\n\n") == CHUNK  # choice 0's closing chunks went out
    assert marks.take(CHUNK + b": ids 2 1  end\n\n") == CHUNK  # ... choice 2's, with no new token
    assert marks.resumable()
    sent = json.loads(marks.continuation(body))
    assert sent["resume"] == {"choices": [{"tokens": [5, 6, 7], "segments": [2, 1], "ended": True},
                                          {"tokens": [], "segments": [], "ended": False},
                                          {"tokens": [9], "segments": [1, 0], "ended": True}],
                              "id": "chatcmpl-9", "created": 1700000001}
    for bad in (b": ids 16 1 4\n\n", b": ids 1 1 4 over\n\n", b": ids 1 2 4\n\n"):  # no such choice; a stray word; a wrong total
        garbled = ReplyMarks()
        garbled.take(CHUNK + bad)
        assert garbled.broken


def test_a_started_reply_needs_its_id_to_go_on() -> None:
    marks = ReplyMarks()
    marks.take(CHUNK + b": ids 0 1 7\n\n")  # no REPLY_HEADER in the head
    assert not marks.resumable()


def test_the_continuation_carries_the_ids_their_split_and_the_reply() -> None:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}).encode()
    marks = ReplyMarks()
    assert marks.continuation(body) == body  # nothing delivered: the request as it was
    marks.head({REPLY_HEADER.lower(): "chatcmpl-9 1700000001"})
    marks.take(CHUNK + b": ids 0 2 5,6\n\n")
    marks.take(CHUNK + b": ids 0 3 7\n\n")
    sent = json.loads(marks.continuation(body))
    assert sent["resume"] == {"tokens": [5, 6, 7], "segments": [2, 1], "id": "chatcmpl-9", "created": 1700000001}
    assert sent["messages"] == [{"role": "user", "content": "hi"}]


def test_each_cut_is_timed_until_the_reply_goes_on() -> None:
    marks = ReplyMarks()
    marks.head({REPLY_HEADER.lower(): "chatcmpl-1 1700000000"})
    marks.take(CHUNK + b": ids 0 1 7\n\n")
    marks.cut()
    assert marks.cuts == 1 and marks.cut_at is not None and marks.latencies_ms == []
    marks.take(CHUNK + b": ids 0 2 8\n\n")
    assert len(marks.latencies_ms) == 1 and marks.latencies_ms[0] >= 0 and marks.cut_at is None
    marks.take(CHUNK + b": ids 0 3 9\n\n")
    assert len(marks.latencies_ms) == 1  # only the first words after a cut count


def test_cuts_back_to_back_are_each_counted_and_timed_as_one_wait_from_the_first() -> None:
    marks = ReplyMarks()
    marks.head({REPLY_HEADER.lower(): "chatcmpl-1 1700000000"})
    marks.take(CHUNK + b": ids 0 1 7\n\n")
    marks.cut()
    first = marks.cut_at
    marks.cut()  # the next engine went away too, before its first words
    assert marks.cuts == 2 and marks.cut_at == first
    marks.take(CHUNK + b": ids 0 2 8\n\n")
    assert len(marks.latencies_ms) == 1 and marks.cut_at is None


def test_a_drain_cut_after_the_last_events_keeps_them_and_their_ids_and_goes_on() -> None:
    marks = ReplyMarks()
    marks.head({REPLY_HEADER.lower(): "chatcmpl-1 1700000000"})
    drained = b'data: {"error":{"message":"cut","type":"server_error","param":null,"code":"drain_timeout"}}\n\n'
    assert marks.take(CHUNK + b": ids 0 2 4,5\n\n" + drained) == CHUNK
    assert marks.ids.tolist() == [4, 5] and marks.stopping and marks.resumable()


def test_an_engine_error_after_the_last_events_reaches_the_caller_and_ends_the_reply() -> None:
    marks = ReplyMarks()
    marks.head({REPLY_HEADER.lower(): "chatcmpl-1 1700000000"})
    failed = b'data: {"error":{"message":"bad","type":"server_error","param":null,"code":"generation_failed"}}\n\n'
    assert marks.take(CHUNK + b": ids 0 1 4\n\n" + failed) == CHUNK + failed
    assert marks.finished and not marks.stopping and not marks.resumable()


def test_a_failed_restart_costs_a_going_on_request_an_attempt_not_its_reply() -> None:
    from mlxd.protocol.errors import APIError
    from mlxd.supervisor.relay.serve import restarts_again

    failed = APIError(503, "Model m could not be loaded: exit code -9", code="model_load_failed")
    marks = ReplyMarks()
    assert not restarts_again(marks, failed, 3)  # not cut yet: a failed start is the caller's answer
    assert not restarts_again(None, failed, 3)  # resume off
    marks.cut()
    assert restarts_again(marks, failed, 3) and marks.cuts == 2
    assert not restarts_again(marks, APIError(503, "cooling down", code="model_failed"), 3)
    assert restarts_again(marks, failed, 3) and marks.cuts == 3
    assert not restarts_again(marks, failed, 3)  # the attempts are spent
