"""The naive baseline's engine: one request's record (`Pending`), the static batcher that groups
waiting requests, and the worker-thread `transformers.generate` call per batch whose streamer hands
each step's tokens back to the event loop, where they are detokenized and checked for stops.

benchmarks/serving/naive_server.py puts this behind HTTP; its docstring says how the baseline serves and why
(static batches, left padding, per-row stops, one seed per batch).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

# The same logger name as naive_server.py's, so a failed batch is logged as before the split.
log = logging.getLogger("naive_server")
_WINDOW = 6  # tokens of left context for incremental detokenization


@dataclass
class Pending:
    """One request from arrival to its final output. `tokens` is filled on the event loop."""

    id: str
    prompt_token_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    stop_flag: bool = False  # set on the event loop (stop string, client gone); read by the worker
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    finish_reason: str | None = None
    batch_size: int = 0

    def sampling_key(self) -> tuple:
        return (self.temperature > 0, self.temperature, self.top_p, self.top_k)


_END = object()  # the batch finished; no more tokens for this request


class _BatchStreamer:
    """A transformers streamer for a whole batch. `generate` calls `put` with the prompt first,
    then once per step with one new token per row ([batch] tensor). Runs on the worker thread;
    tokens go to the event loop with call_soon_threadsafe. It also decides, row by row, when a
    request has all its tokens (count, EOS, stop ids, or the loop's stop_flag)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, batch: list[Pending], eos_token_id: int | None) -> None:
        self.loop, self.batch, self.eos = loop, batch, eos_token_id
        self.counts = [0] * len(batch)
        self.done = [False] * len(batch)
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        toks = value.reshape(-1).tolist()
        deliver = []
        for i, (req, tok) in enumerate(zip(self.batch, toks)):
            if self.done[i]:
                continue
            if req.stop_flag:
                self.done[i] = True
                continue
            deliver.append((req, tok))
            self.counts[i] += 1
            if (self.counts[i] >= req.max_tokens or (not req.ignore_eos and tok == self.eos)
                    or tok in req.stop_token_ids):
                self.done[i] = True
        if deliver:
            self.loop.call_soon_threadsafe(_deliver, deliver)

    def end(self) -> None:
        pass


def _deliver(items) -> None:
    for req, tok in items:
        req.queue.put_nowait(tok)


class NaiveServer:
    def __init__(self, model_path: str, device: str | None = None, dtype: str = "auto", max_batch: int = 32,
                 batch_wait_ms: float = 0.0) -> None:
        from transformers import AutoTokenizer, GenerationConfig, GPT2LMHeadModel

        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
        self.dtype = dtypes[dtype] if dtype != "auto" else (torch.float16 if self.device.type == "cuda" else torch.float32)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        model = GPT2LMHeadModel.from_pretrained(model_path, attn_implementation="eager")
        self.model = model.to(device=self.device, dtype=self.dtype).eval().requires_grad_(False)
        cfg = self.model.config
        self.vocab_size, self.max_model_len = cfg.vocab_size, cfg.n_positions
        eos = self.tokenizer.eos_token_id
        self.eos_token_id = eos if eos is not None else cfg.eos_token_id
        self.pad_token_id = self.tokenizer.pad_token_id
        if self.pad_token_id is None:
            self.pad_token_id = self.eos_token_id if self.eos_token_id is not None else 0
        # No eos in the model's generation config: `generate` fills unset options from it, and EOS is
        # handled per row here (ignore_eos differs between requests of one batch).
        self.model.generation_config = GenerationConfig(pad_token_id=self.pad_token_id, bos_token_id=cfg.bos_token_id)
        self.model_name = model_path
        self.max_batch, self.batch_wait = max_batch, batch_wait_ms / 1000.0
        self.waiting: deque[Pending] = deque()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="naive-generate")
        self.batches = 0

    # -- validation ----------------------------------------------------------------------------
    def validate(self, ids: list[int], max_tokens: int) -> str | None:
        if not ids:
            return "the prompt is empty: give at least one token"
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            return f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})"
        if len(ids) + max_tokens > self.max_model_len:
            return (f"prompt has {len(ids)} tokens and max_tokens is {max_tokens}: {len(ids) + max_tokens} "
                    f"exceeds the model's context of {self.max_model_len} tokens")
        return None

    # -- batching ------------------------------------------------------------------------------
    def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        self._executor.shutdown(wait=True)

    def submit(self, req: Pending) -> None:
        self.waiting.append(req)
        self._wake.set()

    def _take_batch(self) -> list[Pending]:
        while self.waiting and self.waiting[0].stop_flag:  # client went away while waiting
            self._finish_unserved(self.waiting.popleft())
        if not self.waiting:
            return []
        key = self.waiting[0].sampling_key()
        batch, rest = [], deque()
        while self.waiting:
            req = self.waiting.popleft()
            if req.stop_flag:
                self._finish_unserved(req)
            elif len(batch) < self.max_batch and req.sampling_key() == key:
                batch.append(req)
            else:
                rest.append(req)
        self.waiting = rest
        return batch

    @staticmethod
    def _finish_unserved(req: Pending) -> None:
        req.queue.put_nowait(_END)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.waiting:
                self._wake.clear()
                await self._wake.wait()
            if self.batch_wait > 0 and len(self.waiting) < self.max_batch:
                await asyncio.sleep(self.batch_wait)
            batch = self._take_batch()
            if not batch:
                continue
            self.batches += 1
            for req in batch:
                req.batch_size = len(batch)
            try:
                await loop.run_in_executor(self._executor, self._generate, loop, batch)
            except Exception as e:  # a failed batch fails its requests, not the server
                log.exception("generate failed for a batch of %d", len(batch))
                for req in batch:
                    req.queue.put_nowait(e)
                continue
            for req in batch:
                req.queue.put_nowait(_END)

    def _generate(self, loop: asyncio.AbstractEventLoop, batch: list[Pending]) -> None:
        """Worker thread: one left-padded `generate` call for the whole batch."""
        from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

        longest = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), longest), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for i, r in enumerate(batch):
            n = len(r.prompt_token_ids)
            ids[i, longest - n:] = torch.tensor(r.prompt_token_ids, dtype=torch.long)
            mask[i, longest - n:] = 1
        first = batch[0]
        sample = first.temperature > 0
        gen = GenerationConfig(max_new_tokens=max(r.max_tokens for r in batch), min_new_tokens=0, do_sample=sample,
                               pad_token_id=self.pad_token_id, bos_token_id=self.model.config.bos_token_id,
                               **({"temperature": first.temperature, "top_p": first.top_p, "top_k": first.top_k}
                                  if sample else {}))
        streamer = _BatchStreamer(loop, batch, self.eos_token_id)

        class RowsDone(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                return torch.tensor([d or r.stop_flag for d, r in zip(streamer.done, batch)], dtype=torch.bool,
                                    device=input_ids.device)

        seed = next((r.seed for r in batch if r.seed is not None), None)
        if seed is not None:
            torch.manual_seed(seed)
        with torch.inference_mode():
            self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                generation_config=gen, streamer=streamer,
                                stopping_criteria=StoppingCriteriaList([RowsDone()]))

    # -- per-request output (event loop) -------------------------------------------------------
    def _detokenize(self, req: Pending, final: bool) -> str:
        """Same incremental scheme as flashpage (server/engine/detokenize.py): hold back partial characters."""
        ids = req.token_ids
        prefix = self.tokenizer.decode(ids[req.prefix_offset:req.read_offset], skip_special_tokens=True)
        full = self.tokenizer.decode(ids[req.prefix_offset:], skip_special_tokens=True)
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return ""
        new = full[len(prefix):]
        req.read_offset = len(ids)
        req.prefix_offset = max(0, req.read_offset - _WINDOW)
        req.text += new
        return new

    def _accept(self, req: Pending, tok: int) -> tuple[list[int], str]:
        """Append one token; returns ([tok], new text) and sets req.finish_reason when it is the last."""
        req.token_ids.append(tok)
        reason = None
        if (not req.ignore_eos and tok == self.eos_token_id) or tok in req.stop_token_ids:
            reason = "stop"
        elif len(req.token_ids) >= req.max_tokens:
            reason = "length"
        new = self._detokenize(req, final=reason is not None)
        if req.stop and new:
            best = None
            for s in req.stop:
                i = req.text.find(s, max(0, len(req.text) - len(new) - len(s) + 1))
                if i != -1 and (best is None or i < best):
                    best = i
            if best is not None:
                emitted = len(req.text) - len(new)
                req.text = req.text[:best]
                new = req.text[emitted:] if best > emitted else ""
                reason = "stop"
        if reason is not None:
            req.finish_reason = reason
            req.stop_flag = True  # tell the streamer this row is done
        return [tok], new

    async def outputs(self, req: Pending):
        """Yield (token_ids, text) per step until the request is finished."""
        while req.finish_reason is None:
            item = await req.queue.get()
            items = [item]
            while not req.queue.empty():  # everything that has arrived: one event per step normally
                items.append(req.queue.get_nowait())
            toks, text = [], ""
            for item in items:
                if isinstance(item, BaseException):
                    raise item
                if item is _END:
                    req.finish_reason = req.finish_reason or "length"
                    break
                if req.finish_reason is None:
                    t, s = self._accept(req, item)
                    toks += t
                    text += s
            if toks:
                yield toks, text
