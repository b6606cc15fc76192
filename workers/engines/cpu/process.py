"""The CPU engine's core process: `python -m workers.engines.cpu.process --model DIR ...`.

Started by `CpuEngine`, never by hand. It loads the model, says "ready" (or "fatal" and exits
1), then loops: take the front end's messages (blocking only when it has nothing to compute),
run one decode round, send that round's output in one frame.

Why a process and not a thread of the worker: the decode loop of a small model is mostly
Python (transformers' modules), so in the worker's process it held the GIL against the
event loop that records progress, and every Redis round trip slowed decoding (measured:
durable/direct 0.92 with a thread, bench/bench_overhead.py). vLLM runs its engine core in a
process of its own for the same reason.

It ends when told to close, or when the front end's end of either pipe closes (the worker
exited or was killed): a read gives EOF, or a write gives EPIPE, within one round. SIGINT and
SIGTERM are ignored so that a signal sent to the whole process group leaves the engine to
the worker's orderly shutdown, which still needs it to abort requests.
"""

from __future__ import annotations

import argparse
import signal
import sys
import traceback
from typing import TYPE_CHECKING

from workers.engines.cpu.wire import FrameReader, write_frame

if TYPE_CHECKING:
    from workers.engines.cpu.core import EngineCore


def serve(core: EngineCore, reader: FrameReader, out_fd: int) -> None:
    while not core.closing:
        # Idle: sleep until a message comes. Busy: only look, then compute.
        for message in reader.read(0 if core.busy else None):
            core.handle(message)
        if core.busy:
            core.round()
        out = core.take_output()
        if out:
            write_frame(out_fd, out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--weight-version", type=int, default=0)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--in-fd", type=int, required=True)
    parser.add_argument("--out-fd", type=int, required=True)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        import torch  # noqa: PLC0415
        from transformers.utils import logging as hf_logging  # noqa: PLC0415

        from workers.engines.cpu.core import EngineCore  # noqa: PLC0415

        torch.set_num_threads(args.threads)
        hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # a bar per load
        core = EngineCore(args.model, weight_version=args.weight_version)
    except Exception as exc:
        write_frame(args.out_fd, [["fatal", type(exc).__name__, str(exc)]])
        return 1
    write_frame(args.out_fd, [core.ready_message()])
    try:
        serve(core, FrameReader(args.in_fd), args.out_fd)
    except (EOFError, BrokenPipeError):
        return 0  # the front end is gone: nobody is waiting for anything we could say
    except Exception:
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
