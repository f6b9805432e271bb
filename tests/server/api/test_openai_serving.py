"""server/api/openai_serving.py's event encoding: an SSE event is one line for every line splitter,
the JSON unchanged."""

import json

import httpx

from server.api.openai_serving import encode_json, event_json, sse

TEXT = "a\u2028b\u2029c\x85d \u2014 \u00e9\u4e2d\n\"q\""  # the three splitters' breaks, others that are not


def test_event_json_escapes_what_splitlines_breaks_at_and_keeps_the_json():
    obj = {"id": "x\u2028", "text": TEXT, "choices": [{"text": "\u2029" * 3}]}
    data = event_json(obj)
    assert json.loads(data) == obj == json.loads(encode_json(obj))
    for raw in ("\x85", "\u2028", "\u2029"):
        assert raw.encode() not in data
    assert "\u2014".encode() in data and "\u00e9".encode() in data  # other characters stay UTF-8
    assert event_json({"text": "plain"}) == encode_json({"text": "plain"})


def test_a_stream_of_events_reads_back_through_httpx_iter_lines():
    """httpx's iter_lines splits as str.splitlines does: each event's data line whole."""
    objs = [{"text": TEXT, "i": i} for i in range(3)]
    body = b"".join(sse(o) for o in objs) + b"data: [DONE]\n\n"
    resp = httpx.Response(200, content=body)
    lines = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert [json.loads(x) for x in lines[:-1]] == objs and lines[-1] == "[DONE]"
