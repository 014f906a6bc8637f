"""``python tap_engine.py FOLDER MODEL_DIR ENGINE COUNT [hold]``: one engine core in a process of its
own, as vLLM runs each: test_engine_tap's ``Engine`` (vLLM's ``EngineCoreProc`` methods over its
real scheduler) with the tap installed, as engine ``ENGINE``. It adds ``COUNT`` requests
(``e<ENGINE>-r<i>``), steps them to their end (6 tokens each), says goodbye once vLLM sent every
output, and exits; with ``hold``, it steps them twice (64 tokens asked: still in flight), prints
``held`` once vLLM sent those outputs, and waits to be killed."""

from __future__ import annotations

import sys


def main() -> None:
    folder, model_dir, engine, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    hold = sys.argv[5:] == ["hold"]
    from test_engine_tap import Engine, _run_until_finished

    from otel_llm.integrations.vllm.engine_core import engine_tap

    assert engine_tap.install(folder)
    core = Engine(model_dir, index=engine)
    for i in range(count):
        core.add(f"e{engine}-r{i}", prompt=20, max_tokens=64 if hold else 6)
    if hold:
        core.step()
        core.step()
        core.all_sent()
        print("held", flush=True)
        sys.stdin.read()  # until killed
        return
    _run_until_finished(core, count)
    core.all_sent()
    engine_tap._state["tap"].bye()
    core.stop()


if __name__ == "__main__":
    main()
