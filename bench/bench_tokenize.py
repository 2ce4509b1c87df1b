"""CPU per request of turning a chat request into token ids in the router.

Usage: .venv/bin/python bench/bench_tokenize.py [--model-dir DIR] [--repeats N]

For prompts of about 1k, 4k and 16k tokens (a system prompt of English prose plus a
user turn with numbers, sized with the tokenizer itself), times on one core:

* ``hf``: ``HfTokenizer.encode_chat`` over the tiny Llama's tokenizer.json + chat
  template (``~/.cache/fleetgate/models/tiny-llama`` unless ``--model-dir``; byte-level
  BPE, vocab 2048: a small vocabulary gives more tokens per byte than a production one);
* ``loop_stall_inline_ms`` / ``loop_stall_thread_ms``: the longest gap a ticker task
  on the event loop sees while one request is tokenized inline / through
  ``asyncio.to_thread`` (what other requests wait);
* ``emulator``: the emulator's shipped tokenizer files through the same hf code path;
* ``encode_chat_ms`` tokenizes the whole prompt every call (prefix cache off);
  ``shared_system_prompt_ms`` is a request with the same system prompt and a new
  short user turn each call, through the prefix token cache (``tokencache.py``);
* ``keys``: ``block_keys`` of the token ids at block size 16 (the per-block-size cost
  the router pays once per request and block size);
* ``approx``: the approximate view's ``chunk_prompt`` of the rendered request.

The figure is the median of ``--repeats`` timed calls, in milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fleetgate.router.config import TokenizerSpec
from fleetgate.router.scheduling.kvindex import block_keys
from fleetgate.router.scheduling.prefix import chunk_prompt, render_prompt
from fleetgate.router.scheduling.tokenize import HfTokenizer, Tokenizer
from fleetgate.router.tokenizer_files import load_tokenizer

PROSE = (
    "The router keeps a view of which engine holds which blocks of the prompt cache, "
    "and it sends each request where most of its prompt is already cached. "
)
NUMBERS = "order 10234 shipped 2026-11-29 total 4512.75 units 88 ref 77310042; "


def messages_for(tok: Tokenizer, target: int) -> list[dict[str, str]]:
    """A system + user conversation of about ``target`` tokens under ``tok``."""
    unit = len(tok.encode_text(PROSE, add_special_tokens=False)) + len(
        tok.encode_text(NUMBERS, add_special_tokens=False)
    )
    n = max(1, target // unit)
    return [
        {"role": "system", "content": PROSE * n},
        {"role": "user", "content": NUMBERS * n},
    ]


def median_ms(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


async def stall(tok: Tokenizer, msgs: list[dict[str, str]], threaded: bool) -> float:
    """Median longest gap (ms) a 0-sleep ticker on the event loop sees per tokenization:
    what other requests on the loop wait while one request is tokenized."""
    gaps: list[float] = []
    worst = [0.0]
    stop = asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0)
            now = time.perf_counter()
            worst[0] = max(worst[0], now - last)
            last = now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    for _ in range(10):
        worst[0] = 0.0
        if threaded:
            await asyncio.to_thread(tok.encode_chat, msgs)
        else:
            tok.encode_chat(msgs)
            await asyncio.sleep(0)
        await asyncio.sleep(0)
        gaps.append(worst[0])
    stop.set()
    await task
    return statistics.median(gaps) * 1000


def time_one(name: str, make: Callable[[], Tokenizer], target: int, repeats: int) -> dict[str, Any]:
    tok = make()
    if isinstance(tok, HfTokenizer):
        tok.prefix_cache = None  # every call tokenizes the whole prompt
    msgs = messages_for(tok, target)
    ids = tok.encode_chat(msgs)
    body = {"model": "m", "messages": msgs}
    # the prefix token cache: the same system prompt, a new user turn every call
    cached = make()
    turn = iter(range(10**9))

    def next_question() -> list[int]:
        question = f"Question {next(turn)}: {NUMBERS}"
        return cached.encode_chat([msgs[0], {"role": "user", "content": question}])

    return {
        "kind": name,
        "target": target,
        "tokens": len(ids),
        "encode_chat_ms": round(median_ms(lambda: tok.encode_chat(msgs), repeats), 3),
        "shared_system_prompt_ms": round(median_ms(next_question, repeats), 3),
        "keys16_ms": round(median_ms(lambda: block_keys(ids, 16), repeats), 3),
        "approx_ms": round(median_ms(lambda: chunk_prompt(render_prompt(body), 32), repeats), 3),
        "loop_stall_inline_ms": round(asyncio.run(stall(tok, msgs, False)), 3),
        "loop_stall_thread_ms": round(asyncio.run(stall(tok, msgs, True)), 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", default=str(Path.home() / ".cache/fleetgate/models/tiny-llama"))
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    kinds: dict[str, Callable[[], Tokenizer]] = {
        "hf": lambda: load_tokenizer("m", TokenizerSpec(kind="hf", path=args.model_dir)),
        "emulator": lambda: load_tokenizer("m", TokenizerSpec(kind="emulator")),
    }
    for target in (1024, 4096, 16384):
        for name, make in kinds.items():
            print(json.dumps(time_one(name, make, target, args.repeats)), flush=True)


if __name__ == "__main__":
    main()
