"""AsyncEngine built from a factory: the model is loaded in the thread that steps it, and the thread
that started it is kept off OpenMP (cpu_kernels.keep_thread_serial)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.async_engine import AsyncEngine, EngineDeadError
from pdserve.engine.cpu_kernels import keep_thread_serial


def test_a_factory_engine_is_built_and_stepped_in_the_loop_thread(tiny_model):
    threads: dict[str, set[int]] = {"built": set(), "stepped": set()}

    class Recording(LLMEngine):
        def step(self):
            threads["stepped"].add(threading.get_ident())
            return super().step()

    def build() -> LLMEngine:
        threads["built"].add(threading.get_ident())
        config = EngineConfig(model=tiny_model.source.name, load_progress=False, num_kv_blocks=64)
        return Recording(config, loaded=tiny_model)

    async def main() -> list[int]:
        engine = AsyncEngine(build)
        assert engine.engine is None  # nothing is built before start
        await engine.start_async()
        try:
            ids = []
            async for out in engine.generate("a", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=5)):
                ids += out.new_token_ids
            return ids
        finally:
            engine.shutdown()

    result: dict[str, list[int]] = {}
    # in a thread of its own: start() keeps its caller's thread serial, which must not be pytest's
    runner = threading.Thread(target=lambda: result.setdefault("ids", asyncio.run(main())))
    runner.start()
    runner.join()
    assert len(result["ids"]) == 5
    assert len(threads["built"]) == 1 and threads["stepped"] == threads["built"]
    assert threads["built"] != {runner.ident, threading.get_ident()}


def test_a_factory_that_fails_makes_start_raise_it():
    def build() -> LLMEngine:
        raise ValueError("no such model: nowhere")

    def start() -> None:
        AsyncEngine(build).start()

    errors: list[BaseException] = []

    def run() -> None:
        try:
            start()
        except BaseException as e:  # noqa: BLE001 (checked below)
            errors.append(e)

    runner = threading.Thread(target=run)
    runner.start()
    runner.join()
    assert len(errors) == 1 and isinstance(errors[0], EngineDeadError)
    assert "no such model: nowhere" in str(errors[0]) and isinstance(errors[0].__cause__, ValueError)


def test_keep_thread_serial_changes_the_calling_thread_only():
    if not torch.backends.openmp.is_available():
        pytest.skip("torch without OpenMP")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen: dict[str, int] = {}

        def serial() -> None:
            seen["applied"] = keep_thread_serial()
            x = torch.randn(256, 256)
            (x + x).sum()  # a parallel region, run by this thread alone
            seen["serial"] = torch.get_num_threads()

        def other() -> None:
            seen["other"] = torch.get_num_threads()

        for target in (serial, other):
            t = threading.Thread(target=target)
            t.start()
            t.join()
        assert seen == {"applied": True, "serial": 1, "other": 2}
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
