"""The asyncio side of the engine: a consumer that falls behind gets the outputs that waited for it
merged into one (several tokens per SSE event) and loses nothing."""

import asyncio

from server.async_engine import AsyncEngine
from server.config import EngineConfig
from server.engine import LLMEngine
from server.sampling import SamplingParams


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
