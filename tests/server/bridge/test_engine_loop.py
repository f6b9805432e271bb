"""The engine process's loop with several API processes (server/bridge/engine_loop.py), driven in this
process over real pipes: each channel gets exactly its own requests' outputs, a duplicate id from
another channel is refused, a closed channel's requests are aborted and their blocks freed, engine
statistics go to one channel only, and every channel hears a fresh snapshot when the engine idles."""

import pytest

from server.bridge.engine_loop import EngineChannel, _Router
from server.bridge.engine_spawn import channel_pipes
from server.bridge.messages import AbortRequest, AddRequest, StepOutputs, StopEngine, decode_up, encode
from server.config import EngineConfig
from server.engine import LLMEngine
from server.engine.stats import StatsRecorder, StepDone
from server.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    eng = LLMEngine(EngineConfig(model=str(tiny_ckpt), device="cpu", num_blocks=64))
    eng.stats = StatsRecorder()
    return eng


def channels(n):
    """(the engine's channels, the API's ends) of n channels."""
    api, engine_ends = channel_pipes(n)
    return [EngineChannel(*ends) for ends in engine_ends], api


def received(conn) -> list[StepOutputs]:
    msgs = []
    while conn.poll(0.01):
        msgs.append(decode_up(conn.recv_bytes()))
    return msgs


def run(router, engine, max_steps=200):
    """The loop of engine_main, without blocking: until the engine has nothing left."""
    for _ in range(max_steps):
        router.receive(block=False)
        if not engine.has_unfinished():
            router.flush(block=True, fresh=True)
            return
        router.route(engine.step(), engine.stats.take())
        router.flush(block=False, fresh=False)
    raise AssertionError("the engine did not finish")


def tokens(msgs, rid):
    outs = [o for m in msgs for o in m.outputs if o.request_id == rid]
    assert outs and outs[-1].finished and not any(o.finished for o in outs[:-1])
    return [t for o in outs for t in o.new_token_ids]


def test_each_channel_gets_its_own_outputs_and_duplicates_are_refused(engine):
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    alone = engine.generate([[1, 2, 3], [4, 5, 6, 7]], params)
    ends, api = channels(3)
    router = _Router(engine, ends)
    api[0].commands.send_bytes(encode([AddRequest("a", [1, 2, 3], params)]))
    api[1].commands.send_bytes(encode([AddRequest("b", [4, 5, 6, 7], params)]))
    api[2].commands.send_bytes(encode([AddRequest("a", [9, 9], params)]))  # "a" is in flight from channel 0
    run(router, engine)
    got = [received(c.out) for c in api]
    assert tokens(got[0], "a") == alone[0].token_ids and tokens(got[1], "b") == alone[1].token_ids
    assert not any(o.request_id == "b" for m in got[0] for o in m.outputs)
    assert not any(m.outputs for m in got[2])
    refused = [r for m in got[2] for r in m.refused]
    assert [r.request_id for r in refused] == ["a"] and "already in flight" in refused[0].message
    # engine statistics went to channel 0 alone (metrics summed over processes count them once)
    steps = [sum(isinstance(e, StepDone) for m in g for e in m.events) for g in got]
    assert steps[0] > 0 and steps[1] == steps[2] == 0
    # every channel's last message is the idle snapshot
    assert all(g[-1].snapshot.running == 0 and g[-1].snapshot.kv_blocks_free == 64 for g in got)
    assert not router.owner and engine.block_manager.check_all_free()


def test_an_abort_counts_only_from_the_owner_and_a_closed_channel_frees_its_requests(engine):
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ends, api = channels(2)
    router = _Router(engine, ends)
    api[0].commands.send_bytes(encode([AddRequest("x", [1, 2, 3], params), AddRequest("y", [3, 2, 1], params)]))
    api[1].commands.send_bytes(encode([AddRequest("z", [5, 5], params)]))
    router.receive(block=False)
    router.route(engine.step(), engine.stats.take())
    api[1].commands.send_bytes(encode([AbortRequest("x")]))  # not channel 1's request: ignored
    api[0].commands.send_bytes(encode([StopEngine()]))  # API process 0 stops: x and y are aborted
    router.receive(block=False)
    assert router.open == [1] and set(engine.seqs) == {"z"} and set(router.owner) == {"z"}
    api[1].commands.close()  # API process 1 goes away (EOF): z too
    router.receive(block=False)
    assert router.open == [] and not engine.seqs and not router.owner
    assert engine.block_manager.check_all_free()


def test_a_dead_api_process_is_closed_on_a_broken_pipe_and_a_new_channel_takes_its_place(engine):
    """Issue 44, case 2: with one of two API processes killed, the engine's next write to its pipe
    raised BrokenPipeError out of the loop, and the engine and the other API process died. Now the
    write closes that channel (its requests aborted, blocks freed), the other carries on, and the
    channel the parent hands over for the process it starts in its place (server/api/servers.py)
    is greeted with EngineReady and served."""
    import multiprocessing as mp
    import os

    from server.bridge.engine_spawn import reopen_channel
    from server.bridge.messages import EngineReady

    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    ends, api = channels(2)
    parent, theirs = mp.Pipe(duplex=True)
    router = _Router(engine, ends, theirs)
    api[0].commands.send_bytes(encode([AddRequest("x", [1, 2, 3], params)]))
    api[1].commands.send_bytes(encode([AddRequest("z", [5, 5], params)]))
    router.receive(block=False)
    router.route(engine.step(), engine.stats.take())
    api[0].out.close()  # API process 0 is killed: nobody reads its outputs (its commands pipe not yet at EOF)
    router.route(engine.step(), engine.stats.take())
    router.flush(block=False, fresh=True)  # before: BrokenPipeError
    assert router.open == [1] and set(engine.seqs) == {"z"} and set(router.owner) == {"z"}

    new = reopen_channel(parent, 0, os.getpid())  # the parent's new API process 0
    router.receive(block=False)
    assert router.open == [0, 1] and isinstance(decode_up(new.out.recv_bytes()), EngineReady)
    new.commands.send_bytes(encode([AddRequest("x", [1, 2, 3], params)]))  # its ids may reuse the dead one's
    run(router, engine)
    assert len(tokens(received(new.out), "x")) == 30 and len(tokens(received(api[1].out), "z")) == 30
    assert engine.block_manager.check_all_free()


def test_an_api_process_that_reads_nothing_never_stalls_the_engine(engine):
    """Issue 44: an API process restarted in place of a dead one reads nothing for the seconds it
    takes to start; the engine's idle flush blocked on its full pipe, and every other API process's
    requests waited. Now the engine sleeps on commands and on pipes that can take what waits."""
    import select
    import threading

    from server.bridge.engine_loop import turn

    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    ends, api = channels(2)
    router = _Router(engine, ends)
    while select.select([], [ends[0].out], [], 0)[1]:  # channel 0's reader is not reading: its pipe fills
        ends[0].out.send_bytes(b"x" * 60)
    done = []

    def loop():
        stepped = True  # just gone idle: every channel gets the idle snapshot (channel 0's cannot go)
        for _ in range(50):
            stepped = turn(router, engine, engine.stats, stepped)
            if any(o.finished for m in received(api[1].out) for o in m.outputs):
                done.append(True)
                return

    worker = threading.Thread(target=loop, daemon=True)
    worker.start()
    api[1].commands.send_bytes(encode([AddRequest("z", [5, 5], params)]))
    worker.join(30)
    assert done, "the engine stalled on a pipe nobody reads"
    assert router.open == [0, 1] and engine.block_manager.check_all_free()
