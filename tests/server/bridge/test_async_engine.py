"""The asyncio side of the engine: a consumer that falls behind gets the outputs that waited for it
merged into one (several tokens per SSE event) and loses nothing."""

import asyncio

import pytest

from server.bridge.async_engine import AsyncEngine
from server.config import EngineConfig
from server.engine import LLMEngine
from server.sampling_params import SamplingParams


def test_a_slow_consumer_gets_merged_outputs_and_every_token(tiny_ckpt):
    engine = LLMEngine(EngineConfig(model=str(tiny_ckpt), device="cpu", num_blocks=64))
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=1)
    expected = engine.generate([[1, 2, 3]], params)[0]

    async def main():
        aengine = AsyncEngine(engine)
        aengine.start()
        try:
            fast = [o async for o in aengine.generate("fast", [1, 2, 3], params)]
            slow = []
            async for out in aengine.generate("slow", [1, 2, 3], params):
                slow.append(out)
                await asyncio.sleep(0.05)  # the engine runs on meanwhile
            return fast, slow
        finally:
            await aengine.stop()

    fast, slow = asyncio.run(main())
    for outs in (fast, slow):
        assert sum((o.new_token_ids for o in outs), []) == expected.token_ids
        assert "".join(o.new_text for o in outs) == expected.text
        assert len(sum((o.new_logprobs for o in outs), [])) == 40
        assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert len(slow) < len(fast) // 2  # merged while the consumer slept
    assert engine.block_manager.check_all_free()


def test_engine_process_outbox_merges_a_requests_outputs_until_sent():
    # While the API process is behind, the engine process keeps stepping and merges each request's
    # outputs; a failure stays apart, after the tokens before it; the snapshot is taken on send; the
    # typed message survives the pipe (server/bridge/messages.py).
    import multiprocessing as mp

    from server.bridge.engine_loop import _Outbox
    from server.bridge.messages import RequestRefused, StepOutputs, decode_up
    from server.engine import EngineSnapshot, RequestOutput
    from server.engine.stats import StepDone

    snap = EngineSnapshot(0, 0, 0, 0, 24, 24, 0, 0, 0, 0)
    box = _Outbox()
    box.add([RequestOutput("a", "x", [1], False, new_logprobs=[(1, -0.5)], completion_tokens=1, text="x",
                           token_ids=[1]),
             RequestOutput("b", "p", [7], False, completion_tokens=1, text="p", token_ids=[7])], [],
            [StepDone(2, 2, 0.0)])
    box.add([RequestOutput("a", "y", [2], True, "length", new_logprobs=[(2, -0.1)], completion_tokens=2,
                           text="xy", token_ids=[1, 2]),
             RequestOutput("b", "", [], True, "error", text="p", token_ids=[7], error="boom"),
             RequestOutput("d", "z", [5], False, completion_tokens=1, text="wz", token_ids=[4, 5])],
            [RequestRefused("c", "bad")], [StepDone(2, 2, 0.1)])
    reader, writer = mp.Pipe(duplex=False)
    box.flush(writer, lambda: snap, block=False)
    msg = decode_up(reader.recv_bytes())
    assert isinstance(msg, StepOutputs) and msg.snapshot == snap
    assert msg.refused == [RequestRefused("c", "bad")] and msg.events == [StepDone(2, 2, 0.0), StepDone(2, 2, 0.1)]
    a, b1, d, b2 = msg.outputs  # merged outputs in arrival order, then the failures
    assert a == RequestOutput("a", "xy", [1, 2], True, "length", 0, 2, [[1, -0.5], [2, -0.1]], "xy", [1, 2])
    assert (b1.request_id, b1.new_text, b1.new_token_ids, b1.finished) == ("b", "p", [7], False)
    assert (b2.finished, b2.finish_reason, b2.error) == (True, "error", "boom")
    # unfinished: only the new text and ids travel (the API side accumulates them)
    assert (d.new_text, d.new_token_ids, d.text, d.token_ids) == ("z", [5], "", [])
    assert not box.dirty and not box.outputs
    box.flush(writer, lambda: 1 / 0, block=True)  # nothing waits: nothing sent, no snapshot taken
    assert not reader.poll(0.05)


class _StalledCore:
    """A core whose engine never answers (a step that never returns): only the backstop can."""

    def __init__(self, engine):
        self.engine, self.added, self.aborted = engine, [], []

    def start(self, loop, deliver, die):
        pass

    def add(self, request_id, prompt_token_ids, params, deadline=None):
        self.added.append((request_id, deadline))

    def abort(self, request_id):
        self.aborted.append(request_id)

    async def stop(self):
        pass


def test_the_api_side_ends_a_request_whose_engine_stalls_past_its_deadline(tiny_ckpt):
    import time

    engine = LLMEngine(EngineConfig(model=str(tiny_ckpt), device="cpu", num_blocks=8))
    core = _StalledCore(engine)

    async def main():
        aengine = AsyncEngine(engine, request_timeout=0.2)
        aengine.core, aengine.deadline_backstop = core, 0.1
        aengine.start()
        t0 = time.monotonic()
        outs = [o async for o in aengine.generate("r", [1, 2, 3], SamplingParams(max_tokens=4))]
        return outs, time.monotonic() - t0

    outs, elapsed = asyncio.run(main())
    assert [(o.finished, o.finish_reason) for o in outs] == [(True, "timeout")]
    assert 0.25 < elapsed < 5
    (rid, deadline), = core.added
    assert rid == "r" and deadline is not None and core.aborted == ["r"]  # the engine is told to let go


def test_a_command_msgpack_cannot_carry_is_refused_alone():
    from server.bridge.engine_process import EngineClient
    from server.bridge.messages import AbortRequest, AddRequest, decode_down

    client = object.__new__(EngineClient)  # no engine process: only the encoding path
    delivered = []
    client._text = {"big": ("", []), "ok": ("", [])}
    client.id_prefix = ""
    client._deliver = lambda outputs, refused: delivered.extend(refused)
    p = SamplingParams()
    data = client._encode_each([AddRequest("big", [2**64], p), AddRequest("ok", [1], p), AbortRequest("gone")])
    assert [type(c).__name__ for c in decode_down(data)] == ["AddRequest", "AbortRequest"]
    assert [r.request_id for r in delivered] == ["big"] and "cannot be sent" in delivered[0].message
    assert "big" not in client._text and "ok" in client._text


def test_a_step_message_larger_than_the_pipe_arrives_whole_under_uvloop():
    # uvloop makes the descriptor it watches non-blocking; a message only partly written then failed
    # halfway through recv_bytes with EAGAIN, which read as a lost engine (1024 streaming clients).
    import multiprocessing as mp
    import threading

    uvloop = pytest.importorskip("uvloop")
    from server.bridge.engine_process import EngineClient
    from server.bridge.messages import StepOutputs, encode
    from server.engine import EngineSnapshot, RequestOutput

    out_r, out_w = mp.Pipe(duplex=False)
    cmd_r, cmd_w = mp.Pipe(duplex=False)
    client = object.__new__(EngineClient)  # no engine process: only the reading side
    client._cmd, client._out, client._closed, client.id_prefix = cmd_w, out_r, False, ""
    client.stats, client.process, client.unseen_adds = None, None, 0
    n = 3000
    client._text = {f"r{i}": ("", []) for i in range(n)}
    snap = EngineSnapshot(0, 0, 0, 0, 24, 24, 0, 0, 0, 0)
    outputs = [RequestOutput(f"r{i}", "x" * 400, [i], False) for i in range(n)]
    data = encode(StepOutputs(outputs, [], [], snap))
    assert len(data) > 1 << 20  # more than the pipe holds: the reader sees it in pieces

    async def main():
        got, lost = [], []
        done = asyncio.Event()

        def deliver(outs, refused):
            got.extend(outs)
            done.set()

        client.start(asyncio.get_running_loop(), deliver, lost.append)
        writer = threading.Thread(target=out_w.send_bytes, args=(data,))
        writer.start()
        await asyncio.wait_for(done.wait(), 30)
        writer.join()
        return got, lost

    got, lost = uvloop.run(main())
    assert not lost and len(got) == n and got[-1].text == "x" * 400
