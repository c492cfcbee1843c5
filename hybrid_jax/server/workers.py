"""A bounded pool of threads for the CPU work of taking a request in: parsing a large JSON body,
rendering a chat template, tokenizing and checking the prompt (`engine/limits.admit`).

None of it may run on the event loop: a 582 KB prompt takes ~0.6 s to tokenize, and every other
connection (streams, /health) would wait that long. Hugging Face `tokenizers` releases the
interpreter lock while it encodes through `encode_batch` (hybrid_jax/tokenizer.py uses it for long
texts; plain `encode` holds the lock), so tokenization on these threads runs beside the loop;
pure-Python work (JSON, templates, the byte tokenizer) shares the lock with the loop in the
interpreter's 5 ms slices, which bounds what the loop waits. The pool's size bounds how many
requests are being taken in at once, and so the CPU they take from the rest.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import os
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

OFFLOAD_BODY_BYTES = 64 << 10     # bodies at least this large are parsed on the pool (smaller: on the loop)


def default_size() -> int:
    return max(1, min(4, os.cpu_count() or 1))


class Workers:
    def __init__(self, size: int | None = None):
        self.size = size or default_size()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    async def run(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """fn(*args, **kwargs) on a pool thread; its exception is raised here."""
        if self._pool is None:          # made on first use: a ServerState starts no threads
            self._pool = concurrent.futures.ThreadPoolExecutor(self.size, thread_name_prefix="hybrid-jax-admit")
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))
