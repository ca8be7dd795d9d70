"""Every code block in README.md and docs/*.md is run by a test, or says why not.

Docs drift silently: a renamed import or a dropped flag breaks the reader's
first try, not our CI. So:

- ``test_every_code_block_is_run_or_explained`` parses the ```python and
  ```bash blocks of README.md and docs/*.md and fails until each one is in
  ``SNIPPETS``: run by a named test (``RunBy``), or not run with a written
  reason (``NotRun``; some are still checked, e.g. their flags against
  ``--help``). A new block fails the test until it is classified; a table
  entry whose block is gone fails it too.
- The other tests run the snippets for real, each in a subprocess with this
  venv's python (``sys.executable``) under ``trio.fail_after``, and assert on
  what they print or write, not just on "no exception". The snippet's own
  lines are byte for byte as in the doc. What a snippet leaves to the reader
  (``build_model``, ``salt``, the ranks a controller waits for, ...) is
  defined by ``doc_harness.py`` (the ``HARNESS`` text below, written next to
  the snippet) and a small per-snippet driver. Snippets written as top-level
  async code (``async with ...`` at module level) are compiled with
  ``ast.PyCF_ALLOW_TOP_LEVEL_AWAIT``, as an async REPL does, and awaited
  under trio.
- operations.md's two-host launch runs as the page says: the page's salt
  command writes the salt file, and the controller, one relay per host and
  torchrun (``python -m torch.distributed.run``, with the page's flags) are
  parsed out of the bash block and started on this machine. Only addresses,
  ports and paths are substituted; ``launch_plan`` says which and why.

Every subprocess runs in its own session and is killed (its whole process
group) when its test ends, however it ends.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tomllib
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import pytest
import trio

from flodl_trio.testing import open_fault_proxy
from flodl_trio.wire.checkpoint import (
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
)

ROOT = Path(__file__).resolve().parent.parent
LOOP = "127.0.0.1"
VENV_BIN = str(Path(sys.executable).parent)

# ---------------------------------------------------------------------------
# the code blocks of the docs
# ---------------------------------------------------------------------------

LANGUAGES = {"python": "python", "py": "python", "bash": "bash", "sh": "bash", "shell": "bash", "console": "bash"}
FENCE = re.compile(r"^```([\w+-]*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


@attrs.frozen
class CodeBlock:
    path: str  # relative to the repository root
    language: str  # "python" or "bash"
    line: int  # of the opening fence
    text: str

    def headline(self) -> str:
        first = next((line for line in self.text.splitlines() if line.strip()), "")
        return f"{self.path}:{self.line} ```{self.language}: {first.strip()[:70]}"


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def code_blocks(path: Path) -> list[CodeBlock]:
    """The python and bash blocks of one markdown file (other fences are ignored)."""
    text = path.read_text()
    blocks = []
    for match in FENCE.finditer(text):
        language = LANGUAGES.get(match[1].lower())
        if language is not None:
            line = text.count("\n", 0, match.start()) + 1
            blocks.append(CodeBlock(str(path.relative_to(ROOT)), language, line, match[2]))
    return blocks


def all_code_blocks() -> list[CodeBlock]:
    return [block for path in doc_files() for block in code_blocks(path)]


# ---------------------------------------------------------------------------
# the table: every block, and how it is run (or why it is not)
# ---------------------------------------------------------------------------


@attrs.frozen
class RunBy:
    """The block runs, for real, in this test."""

    test: str


@attrs.frozen
class NotRun:
    """The block is not run as is: ``reason`` says why; ``checked_by`` names a
    test that still checks part of it, if one does."""

    reason: str
    checked_by: str | None = None


# A block is identified by its file and a short substring unique within that file.
SNIPPETS: dict[tuple[str, str], RunBy | NotRun] = {
    ("README.md", "pip install -q torch==2.13.0 -e '.[demo]'"): NotRun(
        "both lines create a .venv and pip-install into it, and the second runs the whole test suite "
        "(which would run this test again); the demo command of line 1 runs from the identical line in "
        "docs/quickstart.md",
        checked_by="test_install_lines_name_real_extras_and_modules",
    ),
    ("docs/quickstart.md", "-m flodl_trio.demo"): RunBy("test_quickstart_demo_command"),
    ("docs/quickstart.md", "async def rank(r):"): RunBy("test_quickstart_cluster_inside_one_program"),
    ("docs/quickstart.md", "open_window_trainer("): RunBy("test_quickstart_overlapped_trainer"),
    ("docs/operations.md", "secrets.token_hex(16)"): RunBy("test_operations_two_host_launch_with_torchrun"),
    ("docs/operations.md", "python -m flodl_trio.controller --port"): RunBy(
        "test_operations_two_host_launch_with_torchrun"
    ),
    ("docs/operations.md", "rank_from_env()"): RunBy("test_operations_two_host_launch_with_torchrun"),
    ("docs/liveness.md", "...train..."): NotRun(
        "a fragment: its body is the placeholder `...train...` (not Python) and it uses names it does not "
        "define; the same two nested blocks run for real as operations.md's trainer"
    ),
    ("docs/fault-injection.md", "mean = await client.all_reduce_tensors([t])"): NotRun(
        "a fragment showing one rank's call: alone in a world of 4, that rank would wait for the other three "
        "forever (rounds have no deadline, by design); quickstart.md's cluster is the whole program"
    ),
    ("docs/fault-injection.md", "async def rank_main(rank, client):"): RunBy(
        "test_fault_injection_run_ranks_behind_a_fault_proxy"
    ),
    ("docs/fault-injection.md", "cluster.freeze(3)"): RunBy("test_fault_injection_process_cluster_freeze_and_thaw"),
    ("docs/fault-injection.md", "faults=[CutAt(1000)]"): NotRun(
        "a fragment: the line `...connect rank 1 to proxy.address...` is a placeholder (not Python) for what "
        "the run_ranks snippet above does, which runs"
    ),
    ("docs/fault-injection.md", "async def test_a_dead_rank_and_a_corrupted_frame"): RunBy(
        "test_fault_injection_complete_example_passes_under_pytest"
    ),
    ("docs/fault-injection.md", "async def test_a_silent_connection_is_refused"): RunBy(
        "test_fault_injection_virtual_time_example_passes_under_pytest"
    ),
    ("docs/outer-and-checkpoints.md", 'ConsensusCheckpointer("ckpt/"'): RunBy(
        "test_outer_and_checkpoints_write_then_resume"
    ),
    ("docs/outer-and-checkpoints.md", "outer.load_state_dict(load_checkpoint(path).outer)"): RunBy(
        "test_outer_and_checkpoints_write_then_resume"
    ),
    ("docs/outer-and-checkpoints.md", "restore_module(model, load_checkpoint(path))"): RunBy(
        "test_outer_and_checkpoints_write_then_resume"
    ),
    ("docs/api.md", "start = await client.join(params, buffers)"): NotRun(
        "a fragment (`...` for the inner steps, names it does not define); the same join-then-windows loop "
        "runs for real as operations.md's trainer under torchrun, and with restarts in tests/e2e/test_rejoin*.py"
    ),
    ("docs/wire.md", "benchmarks/codec.py"): NotRun(
        "a timing benchmark (64 MiB x 7 repetitions) whose exit status depends on this machine's speed",
        checked_by="test_benchmark_blocks_name_real_flags",
    ),
    ("docs/performance.md", "--deterministic --quick"): NotRun(
        "a minute-long benchmark (two-host workload: root and tc) whose timings depend on this machine",
        checked_by="test_benchmark_blocks_name_real_flags",
    ),
    ("docs/performance.md", "benchmarks/rejoin.py"): NotRun(
        "a 45 s benchmark of four rank processes with a 64 MiB model whose timings depend on this machine",
        checked_by="test_benchmark_blocks_name_real_flags",
    ),
    ("docs/performance.md", "benchmarks/controller_restart.py"): NotRun(
        "a 35 s benchmark of daemons and four rank processes with a 64 MiB model whose timings depend on this machine",
        checked_by="test_benchmark_blocks_name_real_flags",
    ),
    ("docs/performance.md", "scale.py --hosts 2,4 --ranks-per-host 2"): NotRun(
        "a three-minute benchmark of up to 8 network namespaces (root and tc) whose timings depend on this machine",
        checked_by="test_benchmark_blocks_name_real_flags",
    ),
    ("docs/performance.md", "scale.py --hosts 4 --shards"): NotRun(
        "the same benchmark with a reduction shard on every namespace",
        checked_by="test_benchmark_blocks_name_real_flags",
    ),
    ("docs/performance.md", "benchmarks/allreduce.py --quick"): NotRun(
        "benchmarks of one to several minutes each; the two-host workload needs root and tc",
        checked_by="test_benchmark_blocks_name_real_flags",
    ),
}


def blocks_for(path: str, key: str) -> list[CodeBlock]:
    return [block for block in all_code_blocks() if block.path == path and key in block.text]


def doc_snippet(path: str, key: str) -> str:
    """The text of the block ``SNIPPETS`` lists under (path, key), for the test the table names."""
    entry = SNIPPETS[(path, key)]
    named = entry.test if isinstance(entry, RunBy) else entry.checked_by
    current = os.environ.get("PYTEST_CURRENT_TEST", "").split("::")[-1].split(" ")[0]
    assert current == named, f"SNIPPETS says {named} uses {path} {key!r}, but {current} asked for it"
    (block,) = blocks_for(path, key)
    return block.text


def test_every_code_block_is_run_or_explained():
    """Pure parsing, no I/O beyond reading the docs: nothing here can block."""
    blocks = all_code_blocks()
    assert any(b.language == "python" for b in blocks) and any(b.language == "bash" for b in blocks)
    problems = []
    for block in blocks:
        keys = [key for (path, key) in SNIPPETS if path == block.path and key in block.text]
        if len(keys) != 1:
            what = "is in no SNIPPETS entry" if not keys else f"matches several SNIPPETS keys {keys}"
            problems.append(f"{block.headline()} {what}: run it in a test, or say why it is not run")
    for (path, key), entry in SNIPPETS.items():
        found = blocks_for(path, key)
        if len(found) != 1:
            problems.append(f"SNIPPETS key {path} {key!r} matches {len(found)} blocks, not 1")
        for test in filter(None, [getattr(entry, "test", None), getattr(entry, "checked_by", None)]):
            if not callable(globals().get(test)):
                problems.append(f"SNIPPETS names {test} for {path} {key!r}, and there is no such test")
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------
# what the snippets leave to the reader (written as doc_harness.py next to them)
# ---------------------------------------------------------------------------

HARNESS = r'''
"""What the doc snippets leave to the reader, defined for real (written by tests/test_docs.py).

The snippets themselves stay byte for byte as on their page.
"""
import ast
import json
import os
from pathlib import Path

import torch

torch.set_num_threads(1)

windows = 3  # the trainer's number of averaging windows
INNER_STEPS = 4
MODELS = []  # every model build_model made in this process
_windows_trained = {}  # id(model) -> windows trained


def build_model(seed=None):
    """A tiny real model with parameters and float buffers (BatchNorm's running stats).

    Each rank starts from its own weights (seed = RANK unless given)."""
    seed = int(os.environ.get("RANK", "0")) if seed is None else seed
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 1)
    )
    model.doc_seed = seed
    MODELS.append(model)
    return model


def train_inner_steps(model):
    """INNER_STEPS steps of SGD on this rank's own regression data; returns the step count."""
    done = _windows_trained.get(id(model), 0)
    generator = torch.Generator().manual_seed(1000 * model.doc_seed + done)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model.train()
    for _ in range(INNER_STEPS):
        x = torch.randn(16, 4, generator=generator)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    _windows_trained[id(model)] = done + 1
    return INNER_STEPS


def float_buffers(model):
    return [b for b in model.buffers() if b.is_floating_point()]


def model_state(model):
    return {
        "params": [p.detach().reshape(-1).tolist() for p in model.parameters()],
        "buffers": [b.reshape(-1).tolist() for b in float_buffers(model)],
    }


def record_pid():
    """So the test can reap this process even if its launcher (torchrun) dies first."""
    Path(os.environ["DOC_TEST_OUT"], f"pid-{os.getpid()}").write_text(str(os.getpid()))


def report_rank():
    """The trainer's postamble: write what this rank ended with, for the test to compare."""
    rank = int(os.environ["RANK"])
    (model,) = MODELS
    state = {"rank": rank, "windows_trained": _windows_trained.get(id(model), 0), **model_state(model)}
    Path(os.environ["DOC_TEST_OUT"], f"rank-{rank}.json").write_text(json.dumps(state))
    print(f"rank {rank}: trained {state['windows_trained']} windows", flush=True)


async def run_snippet(path, namespace):
    """Run the snippet in the file ``path`` (byte for byte as on its page) as
    top-level async code in ``namespace``, the way an async REPL does."""
    code = compile(Path(path).read_text(), str(path), "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    result = eval(code, namespace)
    if result is not None:
        await result
'''


def write_harness(directory: Path) -> None:
    (directory / "doc_harness.py").write_text(HARNESS.lstrip())


# ---------------------------------------------------------------------------
# processes: each in its own session, output collected, all killed on the way out
# ---------------------------------------------------------------------------


def snippet_env(**extra: str) -> dict[str, str]:
    """This environment without flodl/torchrun settings, importing this checkout's flodl_trio
    (PYTHONPATH wins over the venv's editable install, which may point at another checkout)."""
    inherited = ("FLODL_", "MASTER_", "TORCHELASTIC_", "PYTEST_")
    launch = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK"}
    env = {k: v for k, v in os.environ.items() if not k.startswith(inherited) and k not in launch}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env.update(extra)
    return env


def kill_group(process: trio.Process, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(process.pid, sig)  # its own session: the group is it and its children
    except ProcessLookupError:
        pass


@attrs.define(eq=False)
class LoggedProcess:
    """A subprocess and everything it wrote (stdout and stderr together)."""

    label: str
    process: trio.Process
    graceful: bool  # stopped with SIGTERM first (torchrun: it then stops its workers)
    output: bytearray = attrs.field(factory=bytearray)
    _grew: trio.Event = attrs.field(factory=trio.Event)
    _eof: bool = False

    @property
    def text(self) -> str:
        return self.output.decode(errors="replace")

    async def pump(self) -> None:
        assert self.process.stdout is not None
        while chunk := await self.process.stdout.receive_some(65536):
            self.output += chunk
            self._grew.set()
        self._eof = True
        self._grew.set()

    async def wait_for(self, needle: str) -> None:
        """Until ``needle`` appears in the output (an AssertionError if the output ends first)."""
        while needle not in self.text:
            if self._eof:
                raise AssertionError(f"{self.label} ended its output before {needle!r}:\n{self.text}")
            self._grew = trio.Event()
            await self._grew.wait()

    async def wait(self, seconds: float) -> int:
        """Its exit status; an AssertionError with its output if it runs past ``seconds``."""
        with trio.move_on_after(seconds):
            return await self.process.wait()
        raise AssertionError(f"{self.label} still running after {seconds} s:\n{self.text}")

    async def finish(self, seconds: float) -> str:
        """Wait for a zero exit; returns the whole output (read to its end)."""
        status = await self.wait(seconds)
        with trio.move_on_after(5):
            while not self._eof:
                self._grew = trio.Event()
                await self._grew.wait()
        assert status == 0, f"{self.label} exited {status}:\n{self.text}"
        return self.text


@attrs.define(eq=False)
class Processes:
    nursery: trio.Nursery
    started: list[LoggedProcess] = attrs.field(factory=list)
    pid_dirs: list[tuple[Path, str]] = attrs.field(factory=list)

    async def start(
        self, label: str, argv: list[str], *, env: dict[str, str], cwd: Path, graceful: bool = False
    ) -> LoggedProcess:
        process = await trio.lowlevel.open_process(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env=env, cwd=cwd, start_new_session=True,
        )
        logged = LoggedProcess(label, process, graceful)
        self.started.append(logged)
        self.nursery.start_soon(logged.pump)
        return logged

    async def run(self, label: str, argv: list[str], *, env: dict[str, str], cwd: Path, seconds: float) -> str:
        """Run to a zero exit; returns its output."""
        return await (await self.start(label, argv, env=env, cwd=cwd)).finish(seconds)

    def reap_pids_in(self, directory: Path, marker: str) -> None:
        """On the way out, also kill the processes that wrote ``pid-N`` files here
        (grandchildren in sessions of their own) if their command line names ``marker``."""
        self.pid_dirs.append((directory, marker))

    async def stop_all(self) -> None:
        for logged in self.started:
            if logged.process.returncode is None and logged.graceful:
                logged.process.send_signal(signal.SIGTERM)
                with trio.move_on_after(10):
                    await logged.process.wait()
            if logged.process.returncode is None:
                kill_group(logged.process)
            await logged.process.wait()
        for directory, marker in self.pid_dirs:
            for pid_file in directory.glob("pid-*"):
                pid = int(pid_file.read_text())
                try:
                    if marker in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                        os.kill(pid, signal.SIGKILL)
                except (FileNotFoundError, ProcessLookupError):
                    pass


@asynccontextmanager
async def open_processes() -> AsyncIterator[Processes]:
    """A nursery for the output pumps; the block's own error comes out as itself."""
    try:
        async with trio.open_nursery() as nursery:
            processes = Processes(nursery)
            try:
                yield processes
            finally:
                with trio.CancelScope(shield=True), trio.move_on_after(30):
                    await processes.stop_all()
                nursery.cancel_scope.cancel()  # output pumps held open by anything that escaped
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise


async def run_python(script: Path, *args: str, seconds: float, env: dict[str, str] | None = None) -> str:
    """Run a script (cwd: its folder) to a zero exit under a deadline; returns its output."""
    async with open_processes() as processes:
        return await processes.run(
            script.name, [sys.executable, str(script), *args], env=env or snippet_env(), cwd=script.parent,
            seconds=seconds,
        )


def last_json_line(output: str) -> dict:
    return json.loads([line for line in output.splitlines() if line.startswith("{")][-1])


@pytest.mark.deadline(60)
async def test_snippet_processes_import_this_checkout(tmp_path):
    async with open_processes() as processes:
        found = await processes.run("import check", [sys.executable, "-c", "import flodl_trio; print(flodl_trio.__file__)"],
                                    env=snippet_env(), cwd=tmp_path, seconds=50)
    assert Path(found.strip()).is_relative_to(ROOT), found


# ---------------------------------------------------------------------------
# README.md and quickstart.md
# ---------------------------------------------------------------------------


def test_install_lines_name_real_extras_and_modules():
    """The README's install lines are not run (see SNIPPETS); what they name must exist."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = pyproject["project"]["optional-dependencies"]
    import torch

    lines = doc_snippet("README.md", "pip install -q torch==2.13.0 -e '.[demo]'").strip().splitlines()
    assert len(lines) == 2
    for line in lines:
        words = shlex.split(line)
        (extra,) = re.findall(r"^\.\[(\w+)\]$", words[words.index("-e") + 1])
        assert extra in extras, (line, sorted(extras))
        (pin,) = [w.split("==")[1] for w in words if w.startswith("torch==")]
        assert torch.__version__.split("+")[0] == pin, "the pinned torch is the one this venv tests against"
        module = words[words.index("-m", words.index("&&", words.index("install"))) + 1]
        assert importlib.util.find_spec(module) is not None, module


@pytest.mark.deadline(120)
async def test_quickstart_demo_command(tmp_path):
    """The quickstart's demo command, without the venv and pip steps before it (they would
    create a .venv and install into it): the demo itself, with this venv's python."""
    (line,) = doc_snippet("docs/quickstart.md", "-m flodl_trio.demo").strip().splitlines()
    demo = shlex.split(line.split("&&")[-1])
    assert demo[0] == ".venv/bin/python", demo
    async with open_processes() as processes:
        output = await processes.run(
            "demo", [sys.executable, *demo[1:]], env=snippet_env(TMPDIR=str(tmp_path)), cwd=tmp_path, seconds=110
        )
    assert "killed rank 3 (SIGKILL)" in output, output
    assert "restarted rank 3 with the same command" in output, output
    assert re.search(r"\| windows trained\s+\| \d+", output), output
    # The restarted rank rejoins (4 -> 3 -> 4 here; on a slow machine it may be back only
    # once the others finished: then it is let in alone, after the last window).
    assert re.search(r"\| live ranks\s+\| 4 -> 3( -> 4)? \|", output), output
    assert re.search(r"\| rejoins\s+\| 1 \|", output), output
    assert (tmp_path / "flodl_demo.png").stat().st_size > 0


@pytest.mark.deadline(60)
async def test_quickstart_cluster_inside_one_program(tmp_path):
    script = tmp_path / "cluster.py"
    script.write_text(doc_snippet("docs/quickstart.md", "async def rank(r):"))
    output = await run_python(script, seconds=50)
    # each rank prints its rank and the mean of 0, 1, 2, 3 in all three elements
    printed = sorted(line for line in output.splitlines() if re.match(r"\d \[tensor", line))
    assert printed == [f"{r} [tensor([1.5000, 1.5000, 1.5000])]" for r in range(4)], output


OVERLAPPED_TRAINER_DRIVER = r'''
"""Runs quickstart.md's trainer snippet as the body of each rank of a 2-host cluster whose
controller runs DiLoCo (what the snippet's outer= says), with the names it leaves to the reader."""
import json, textwrap

import torch, trio

from flodl_trio import SessionSalt, connect_reduce_client
from flodl_trio import DiLoCoNesterov
from flodl_trio.testing import open_local_cluster

SNIPPET = open("snippet.py").read()
CODE = "async def snippet():\n" + textwrap.indent(SNIPPET, "    ") + "\n    return trainer\n"


async def main():
    salt = SessionSalt.generate()
    async with open_local_cluster(world_size=2, hosts=[[0], [1]], salt=salt,
                                  outer_optimizer=DiLoCoNesterov(0.7, 0.9)) as cluster:
        async def run_rank(rank):
            torch.manual_seed(0)
            model = torch.nn.Linear(4, 1)
            batches = iter(lambda: torch.randn(8, 4) + rank, None)
            scope = {
                "model": model, "loss_fn": lambda out: out.pow(2).mean(), "batches": batches,
                "optimizer": torch.optim.SGD(model.parameters(), lr=0.05), "params": list(model.parameters()),
                "buffers": [], "relay": cluster.relay_address(rank), "rank": rank, "world": 2, "salt": salt,
                "total_steps": 300, "connect_reduce_client": connect_reduce_client,
            }
            exec(CODE, scope)
            trainer = await scope["snippet"]()
            weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            print(json.dumps({"rank": rank, "windows": trainer.stats.windows, "steps": trainer.stats.steps,
                              "weights": weights.tolist()}), flush=True)

        async with trio.open_nursery() as nursery:
            for rank in range(2):
                nursery.start_soon(run_rank, rank)


trio.run(main)
'''


async def test_quickstart_overlapped_trainer(tmp_path):
    (tmp_path / "snippet.py").write_text(doc_snippet("docs/quickstart.md", "open_window_trainer("))
    (tmp_path / "driver.py").write_text(OVERLAPPED_TRAINER_DRIVER)
    output = await run_python(tmp_path / "driver.py", seconds=50)
    results = [json.loads(line) for line in output.splitlines() if line.startswith('{"rank"')]
    assert sorted(r["rank"] for r in results) == [0, 1], output
    assert all(r["windows"] == 3 and r["steps"] == 300 for r in results), results  # 300 steps, sync_every=100
    assert results[0]["weights"] == results[1]["weights"], results  # both end on the last consensus
    assert "held up by the network for" in output


# ---------------------------------------------------------------------------
# operations.md: the salt, the two-host launch, the trainer
# ---------------------------------------------------------------------------


@attrs.frozen
class ShellCommand:
    argv: list[str]
    background: bool

    def flag(self, name: str) -> str:
        assert name in self.argv, f"{name} is no longer in {shlex.join(self.argv)}"
        return self.argv[self.argv.index(name) + 1]

    def own(self, values: dict[str, str]) -> dict[str, str]:
        """Those of ``values`` whose flag this command has."""
        return {name: value for name, value in values.items() if name in self.argv}

    def with_flags(self, values: dict[str, str]) -> list[str]:
        """argv with these flags' values replaced (each flag must be there)."""
        argv = list(self.argv)
        for name, value in values.items():
            self.flag(name)
            argv[argv.index(name) + 1] = value
        return argv


@attrs.define
class MachineSection:
    """The commands under one ``# on MACHINE (note)`` comment of a bash block."""

    machine: str
    note: str
    exports: dict[str, str] = attrs.field(factory=dict)
    commands: list[ShellCommand] = attrs.field(factory=list)

    def variant(self) -> tuple[str, dict[str, str]]:
        """'on gpu-b: --ranks 2,3 and --node-rank 1' -> ('gpu-b', {'--ranks': '2,3', '--node-rank': '1'})."""
        match = re.fullmatch(r"on (\S+): (.+)", self.note)
        assert match, f"expected '(on HOST: --flag value and ...)' after '# on {self.machine}', got {self.note!r}"
        return match[1], dict(part.split() for part in match[2].split(" and "))


def machine_sections(block: str) -> list[MachineSection]:
    sections: list[MachineSection] = []
    for line in block.replace("\\\n", " ").splitlines():
        if header := re.fullmatch(r"#\s*on\s+(\S+)(?:\s+\((.*)\))?\s*", line.strip()):
            sections.append(MachineSection(header[1], header[2] or ""))
        elif line.startswith("export "):
            sections[-1].exports.update(word.split("=", 1) for word in shlex.split(line)[1:])
        elif line.strip():
            words = shlex.split(line)
            background = words[-1] == "&"
            sections[-1].commands.append(ShellCommand(words[:-1] if background else words, background))
    return sections


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((LOOP, port))
        except OSError:
            return False
    return True


def free_ports_with_relay_offsets(count: int) -> list[int]:
    """``count`` free ports P whose P+4 and P+5 (a host relay's loopback ports: flodl_trio.daemon.launch)
    are free too, none of them overlapping."""
    chosen: list[int] = []
    while len(chosen) < count:
        with socket.socket() as s:
            s.bind((LOOP, 0))
            port = s.getsockname()[1]
        taken = {p + k for p in chosen for k in (0, 4, 5)}
        wanted = {port, port + 4, port + 5}
        if port + 5 <= 65535 and not wanted & taken and all(port_is_free(p) for p in wanted):
            chosen.append(port)
    return chosen


def free_port(avoid: Iterable[int]) -> int:
    while True:
        with socket.socket() as s:
            s.bind((LOOP, 0))
            port = s.getsockname()[1]
        if port not in set(avoid):
            return port


async def write_salt_as_the_page_does(path: Path) -> None:
    """Run the page's salt command, writing to ``path`` instead of /run/flodl/salt
    (with this venv's bin first on PATH, so its ``python`` is this venv's)."""
    command = doc_snippet("docs/operations.md", "secrets.token_hex(16)").strip()
    assert command.count(PAGE_SALT_PATH) == 2, command
    command = command.replace(PAGE_SALT_PATH, str(path))
    env = snippet_env(PATH=os.pathsep.join([VENV_BIN, os.environ.get("PATH", "")]))
    async with open_processes() as processes:
        await processes.run("salt command", ["bash", "-c", command], env=env, cwd=path.parent, seconds=30)
    assert re.fullmatch(r"[0-9a-f]{32}\n", path.read_text())
    assert path.stat().st_mode & 0o777 == 0o600


PAGE_SALT_PATH = "/run/flodl/salt"

TRAINER_PREAMBLE = """\
# preamble (tests/test_docs.py): the names the page's trainer leaves to you
from doc_harness import build_model, float_buffers, record_pid, train_inner_steps, windows
record_pid()
# --- docs/operations.md, byte for byte ---
"""

TRAINER_POSTAMBLE = """\
# --- end of the page's snippet; postamble (tests/test_docs.py) ---
from doc_harness import report_rank
report_rank()
"""


@attrs.frozen
class LaunchPlan:
    """The page's launch, made runnable on this one machine."""

    controller: list[str]
    controller_env: dict[str, str]
    relays: dict[str, list[str]]  # host -> argv
    torchruns: dict[str, list[str]]
    host_envs: dict[str, dict[str, str]]
    world_size: int


def launch_plan(
    block: str, *, salt_file: Path, checkpoint_dir: Path, train_py: Path, out_dir: Path,
    controller_port: int, forwarded_port: int, master_port: int,
) -> LaunchPlan:
    """The commands of the page's launch block, with these substitutions and no others:

    - ``python`` -> this venv's python; ``torchrun`` -> ``python -m torch.distributed.run``
      (what the torchrun script runs; this venv's bin need not be on PATH);
    - the controller's ``--port`` and the port in ``FLODL_CONTROLLER`` -> a free port;
      ``10.0.0.1`` and ``--master-addr gpu-a`` -> 127.0.0.1 (both hosts are this machine);
      ``--master-port`` -> a free port; ``--checkpoint-dir``, the salt file and ``train.py``
      -> paths under the test's temp dir;
    - the controller listens on 127.0.0.1 (``FLODL_CONTROLLER_HOST``) instead of every
      interface (the page leaves ``--host`` at its default 0.0.0.0);
    - each host's relay gets ``FLODL_HOST_NAME`` (gpu-a, gpu-b), since both would
      otherwise name themselves after this machine;
    - the second host reaches the controller through a loopback forwarder on another
      port (``forwarded_port``): a relay's loopback ports are controller port + 4 and
      + 5, where the ranks look for them, so two relays on one machine would collide.
      Only its ``FLODL_CONTROLLER`` differs; its relay and ranks find their ports the
      way the page says.
    """
    control_section, host_section = machine_sections(block)
    (controller,) = control_section.commands
    relay, torchrun = host_section.commands
    assert controller.argv[:3] == ["python", "-m", "flodl_trio.controller"], controller
    assert relay.argv[:3] == ["python", "-m", "flodl_trio.relay"] and relay.background, relay
    assert torchrun.argv[0] == "torchrun" and torchrun.argv[-1] == "train.py", torchrun

    # the page agrees with itself
    page_controller = f"{control_section.machine}:{controller.flag('--port')}"
    assert host_section.exports["FLODL_CONTROLLER"] == page_controller
    assert control_section.exports["FLODL_SALT_FILE"] == host_section.exports["FLODL_SALT_FILE"] == PAGE_SALT_PATH
    world = int(controller.flag("--world-size"))
    assert int(relay.flag("--world-size")) == world
    assert int(torchrun.flag("--nnodes")) * int(torchrun.flag("--nproc-per-node")) == world
    assert torchrun.flag("--master-addr") == host_section.machine  # torchrun's rendezvous on gpu-a

    other_host, other_flags = host_section.variant()  # each of its flags goes to the command that has it
    assert all(flag in relay.argv or flag in torchrun.argv for flag in other_flags), other_flags
    hosts = {host_section.machine: {}, other_host: other_flags}
    ports = {host_section.machine: controller_port, other_host: forwarded_port}
    python = [sys.executable]
    exports = {**control_section.exports, "FLODL_SALT_FILE": str(salt_file)}
    controller_env = snippet_env(**exports, FLODL_CONTROLLER_HOST=LOOP)
    host_envs = {
        host: snippet_env(
            **{**host_section.exports, "FLODL_SALT_FILE": str(salt_file), "FLODL_CONTROLLER": f"{LOOP}:{ports[host]}"},
            FLODL_HOST_NAME=host, DOC_TEST_OUT=str(out_dir),
        )
        for host in hosts
    }
    relays = {host: python + relay.with_flags(relay.own(flags))[1:] for host, flags in hosts.items()}
    torchrun_flags = {"--master-addr": LOOP, "--master-port": str(master_port)}
    torchruns = {
        host: [sys.executable, "-m", "torch.distributed.run",
               *torchrun.with_flags({**torchrun_flags, **torchrun.own(flags)})[1:-1], str(train_py)]
        for host, flags in hosts.items()
    }
    controller_argv = python + controller.with_flags(
        {"--port": str(controller_port), "--checkpoint-dir": str(checkpoint_dir)}
    )[1:]
    return LaunchPlan(controller_argv, controller_env, relays, torchruns, host_envs, world)


@pytest.mark.deadline(240)
async def test_operations_two_host_launch_with_torchrun(tmp_path):
    """operations.md end to end: salt file, controller, a relay per host, torchrun per host
    running the page's trainer; every process exits 0, the ranks end on one consensus,
    and the controller's checkpoint holds it."""
    salt_file, ckpt, out = tmp_path / "salt", tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    await write_salt_as_the_page_does(salt_file)

    trainer = doc_snippet("docs/operations.md", "rank_from_env()")
    train_py = tmp_path / "train.py"
    train_py.write_text(TRAINER_PREAMBLE + trainer + TRAINER_POSTAMBLE)
    write_harness(tmp_path)

    controller_port, forwarded_port = free_ports_with_relay_offsets(2)
    master_port = free_port(avoid={p + k for p in (controller_port, forwarded_port) for k in (0, 4, 5)})
    plan = launch_plan(
        doc_snippet("docs/operations.md", "python -m flodl_trio.controller --port"),
        salt_file=salt_file, checkpoint_dir=ckpt, train_py=train_py, out_dir=out,
        controller_port=controller_port, forwarded_port=forwarded_port, master_port=master_port,
    )
    # no FLODL_SALT_HEX anywhere: daemons and trainers can only have the salt from the file
    assert all("FLODL_SALT_HEX" not in env for env in [plan.controller_env, *plan.host_envs.values()])

    async with open_processes() as processes:
        processes.reap_pids_in(out, marker=str(train_py))
        controller = await processes.start("controller", plan.controller, env=plan.controller_env, cwd=tmp_path)
        with trio.fail_after(30):
            await controller.wait_for("controller started")
        async with open_fault_proxy((LOOP, controller_port), [], port=forwarded_port):  # second_host's route
            relays = {}
            for host, argv in plan.relays.items():
                relays[host] = await processes.start(f"relay {host}", argv, env=plan.host_envs[host], cwd=tmp_path)
            with trio.fail_after(30):
                for host, relay in relays.items():
                    await relay.wait_for(f"relay {host} started")
            torchruns = [
                await processes.start(f"torchrun on {host}", argv, env=plan.host_envs[host], cwd=tmp_path,
                                      graceful=True)
                for host, argv in plan.torchruns.items()
            ]
            outputs = [await torchrun.finish(180) for torchrun in torchruns]
            for relay in relays.values():
                await relay.finish(30)
        controller_log = await controller.finish(30)

    assert "controller finished" in controller_log, controller_log
    assert "outer=DiLoCoNesterov" in controller_log  # --outer diloco
    for host, relay in relays.items():
        assert f"relay {host} data summary" in relay.text, relay.text
    for rank in range(plan.world_size):
        assert any(f"rank {rank}: trained 3 windows" in output for output in outputs), outputs

    # every rank ended on the same consensus, and the newest checkpoint is that consensus
    states = [json.loads((out / f"rank-{rank}.json").read_text()) for rank in range(plan.world_size)]
    assert all(s["params"] == states[0]["params"] and s["buffers"] == states[0]["buffers"] for s in states)
    assert len(list_checkpoints(ckpt)) == 3, sorted(ckpt.iterdir())  # a window each; --checkpoint-keep 3
    checkpoint = load_checkpoint(latest_checkpoint(ckpt))
    assert checkpoint.mass == plan.world_size * 4  # every rank's INNER_STEPS (doc_harness), gamma 1
    assert checkpoint.outer_config is not None and checkpoint.outer_config["type"] == "DiLoCoNesterov"
    assert [c.reshape(-1).tolist() for c in checkpoint.params] == states[0]["params"]
    assert [c.reshape(-1).tolist() for c in checkpoint.buffers] == states[0]["buffers"]


# ---------------------------------------------------------------------------
# fault-injection.md
# ---------------------------------------------------------------------------

RUN_RANKS_DRIVER = """\
\"\"\"Runs fault-injection.md's run_ranks snippet (snippet.py) inside a 4-rank local cluster,
with the names it leaves to the reader: cluster, results, t and the fault-proxy imports.\"\"\"
import json
import torch
import trio
from doc_harness import run_snippet
from flodl_trio import SessionSalt
from flodl_trio.testing import BandwidthCap, open_fault_proxy, open_local_cluster


async def main():
    salt = SessionSalt.generate()
    namespace = {"results": {}, "t": torch.tensor([1.0, 2.0, 3.0]),
                 "open_fault_proxy": open_fault_proxy, "BandwidthCap": BandwidthCap}
    async with open_local_cluster(world_size=4, hosts=[[0, 1], [2, 3]], salt=salt) as cluster:
        namespace["cluster"] = cluster
        await run_snippet("snippet.py", namespace)
    results = {rank: [t.tolist() for t in tensors] for rank, tensors in namespace["results"].items()}
    slow = namespace["slow"]
    print(json.dumps({"results": results, "proxied_up": slow.connections[0].up.bytes_out,
                      "proxied_down": slow.connections[0].down.bytes_out}))

trio.run(main)
"""


@pytest.mark.deadline(60)
async def test_fault_injection_run_ranks_behind_a_fault_proxy(tmp_path):
    (tmp_path / "snippet.py").write_text(doc_snippet("docs/fault-injection.md", "async def rank_main(rank, client):"))
    write_harness(tmp_path)
    (tmp_path / "driver.py").write_text(RUN_RANKS_DRIVER)
    report = last_json_line(await run_python(tmp_path / "driver.py", seconds=50))
    assert report["results"] == {str(rank): [[1.0, 2.0, 3.0]] for rank in range(4)}
    assert report["proxied_up"] > 0 and report["proxied_down"] > 0  # rank 1 went through the proxy


PROCESS_CLUSTER_DRIVER = """\
\"\"\"Runs fault-injection.md's freeze/thaw snippet (snippet.py) with a salt and its import.\"\"\"
import json
import trio
from doc_harness import run_snippet
from flodl_trio import SessionSalt
from flodl_trio.testing import open_process_cluster


async def main():
    namespace = {"salt": SessionSalt.generate(), "open_process_cluster": open_process_cluster}
    with trio.fail_after(60):
        await run_snippet("snippet.py", namespace)
    print(json.dumps({"event": namespace["event"], "outcome": namespace["outcome"]}))

trio.run(main)
"""


@pytest.mark.deadline(90)
async def test_fault_injection_process_cluster_freeze_and_thaw(tmp_path):
    (tmp_path / "snippet.py").write_text(doc_snippet("docs/fault-injection.md", "cluster.freeze(3)"))
    write_harness(tmp_path)
    (tmp_path / "driver.py").write_text(PROCESS_CLUSTER_DRIVER)
    report = last_json_line(await run_python(tmp_path / "driver.py", seconds=80))
    event, outcome = report["event"], report["outcome"]
    # round 3 of rank 0: ranks 0-2 contribute (r + 1) * (k + 1), rank 3 is declared dead
    assert event["round"] == 3 and event["mass"] == 3 and event["value"] == (1 + 2 + 3) * 4 / 3, event
    assert outcome["event"] == "error" and outcome["type"] == "RankDeadError", outcome


@pytest.mark.deadline(90)
async def test_fault_injection_complete_example_passes_under_pytest(tmp_path):
    example = doc_snippet("docs/fault-injection.md", "async def test_a_dead_rank_and_a_corrupted_frame")
    (tmp_path / "test_example.py").write_text(example)
    async with open_processes() as processes:
        output = await processes.run(
            "pytest", [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "trio_mode=true",
                       "test_example.py"],
            env=snippet_env(), cwd=tmp_path, seconds=80,
        )
    assert re.search(r"\b1 passed\b", output), output


async def test_fault_injection_virtual_time_example_passes_under_pytest(tmp_path):
    example = doc_snippet("docs/fault-injection.md", "async def test_a_silent_connection_is_refused")
    (tmp_path / "test_virtual_example.py").write_text(example)
    async with open_processes() as processes:
        output = await processes.run(
            "pytest", [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "trio_mode=true",
                       "test_virtual_example.py"],
            env=snippet_env(), cwd=tmp_path, seconds=80,
        )
    assert re.search(r"\b1 passed\b", output), output


# ---------------------------------------------------------------------------
# outer-and-checkpoints.md: write checkpoints, then resume from them
# ---------------------------------------------------------------------------

CHECKPOINTS_DRIVER = """\
\"\"\"Runs outer-and-checkpoints.md's Checkpoints snippet (snippet.py) with what it leaves out:
the session salt, and the eight ranks its controller waits for (one host relay, two windows
of average_window each, the model of doc_harness).\"\"\"
import sys
from pathlib import Path
import trio
from doc_harness import build_model, float_buffers, run_snippet, train_inner_steps
from flodl_trio import ChannelKind, SessionSalt, average_window, connect_reduce_client, open_relay

PORT = int(sys.argv[1])
WORLD = 8


async def ranks(salt):
    async with open_relay(ChannelKind.DATA, listen=("127.0.0.1", 0), upstream=("127.0.0.1", PORT),
                          host_name="host0", ranks=range(WORLD), world_size=WORLD, salt=salt) as relay:
        async def rank(r):
            model = build_model(seed=r)
            async with connect_reduce_client(("127.0.0.1", relay.port), r, WORLD, salt) as client:
                for window in range(2):
                    steps = await trio.to_thread.run_sync(train_inner_steps, model)
                    await average_window(client, list(model.parameters()), float_buffers(model), steps,
                                         rank=r, world_size=WORLD, in_place=True)

        async with trio.open_nursery() as nursery:
            for r in range(WORLD):
                nursery.start_soon(rank, r)


async def main():
    salt = SessionSalt.generate()
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_snippet, "snippet.py", {"salt": salt})
            nursery.start_soon(ranks, salt)
    print("checkpoints:", " ".join(p.name for p in sorted(Path("ckpt").glob("*.safetensors"))))

trio.run(main)
"""

RESUME_CONTROLLER_DRIVER = """\
\"\"\"Runs the controller-side resume snippet (snippet.py) in the folder the Checkpoints snippet wrote.\"\"\"
import json
import trio
from doc_harness import run_snippet
from flodl_trio import DiLoCoNesterov


async def main():
    namespace = {"DiLoCoNesterov": DiLoCoNesterov}  # imported by the page's previous snippet
    await run_snippet("snippet.py", namespace)
    print(json.dumps({"path": namespace["path"].name, "windows": int(namespace["outer"].state_dict()["windows"][0])}))

trio.run(main)
"""

RESUME_RANK_DRIVER = """\
\"\"\"Runs the rank-side resume snippet (snippet.py) as rank 0 of a one-rank cluster, in the
folder the Checkpoints snippet wrote; build_model is the model the eight ranks trained.\"\"\"
import json
import numpy as np
import trio
from doc_harness import build_model, run_snippet
from flodl_trio import SessionSalt, average_window, connect_reduce_client
from flodl_trio.wire.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint
from flodl_trio.testing import open_local_cluster


async def main():
    salt = SessionSalt.generate()
    async with open_local_cluster(world_size=1, hosts=[[0]], salt=salt) as cluster:
        async with connect_reduce_client(cluster.relay_address(0), 0, 1, salt) as client:
            namespace = {"build_model": build_model, "average_window": average_window, "client": client,
                         "steps": 4, "rank": 0, "world": 1}
            with trio.fail_after(30):
                await run_snippet("snippet.py", namespace)
    checkpoint = load_checkpoint(latest_checkpoint("ckpt/"))
    same = lambda tensors, arrays: len(tensors) == len(arrays) and all(
        np.array_equal(t.detach().numpy(), a) for t, a in zip(tensors, arrays))
    result = namespace["result"]
    print(json.dumps({
        "restored_params": same(namespace["params"], checkpoint.params),
        "restored_buffers": same(namespace["buffers"], checkpoint.buffers),
        "averaged_params": same(result.params, checkpoint.params),
        "buffers": len(checkpoint.buffers),
    }))

trio.run(main)
"""


@pytest.mark.deadline(120)
async def test_outer_and_checkpoints_write_then_resume(tmp_path):
    """The page's three snippets in its order, in one folder: the controller writes ckpt/,
    the controller side resumes the outer optimizer from it, a rank restores its model."""
    page = "docs/outer-and-checkpoints.md"
    write_harness(tmp_path)
    env = snippet_env()

    port = free_port(avoid=())
    checkpoints = doc_snippet(page, 'ConsensusCheckpointer("ckpt/"')
    # the page's controller listens on every interface at 7700; here on loopback at a free port
    assert checkpoints.count('open_controller("0.0.0.0", 7700,') == 1
    (tmp_path / "snippet.py").write_text(checkpoints.replace('"0.0.0.0", 7700', f'"{LOOP}", {port}'))
    (tmp_path / "driver.py").write_text(CHECKPOINTS_DRIVER)
    output = await run_python(tmp_path / "driver.py", str(port), seconds=80, env=env)
    written = sorted((tmp_path / "ckpt").glob("*.safetensors"))
    assert len(written) == 2, output  # one per window (every=1, keep=3)
    latest = load_checkpoint(written[-1])
    assert latest.outer_config == {"type": "DiLoCoNesterov", "lr": 0.7, "momentum": 0.9}
    assert latest.mass == 8 * 4  # eight ranks, gamma 1: mass = the steps each took

    (tmp_path / "snippet.py").write_text(doc_snippet(page, "outer.load_state_dict(load_checkpoint(path).outer)"))
    (tmp_path / "driver.py").write_text(RESUME_CONTROLLER_DRIVER)
    resumed = last_json_line(await run_python(tmp_path / "driver.py", seconds=30, env=env))
    assert resumed == {"path": written[-1].name, "windows": int(latest.outer["windows"][0])}
    assert resumed["windows"] == 2

    (tmp_path / "snippet.py").write_text(doc_snippet(page, "restore_module(model, load_checkpoint(path))"))
    (tmp_path / "driver.py").write_text(RESUME_RANK_DRIVER)
    rank = last_json_line(await run_python(tmp_path / "driver.py", seconds=60, env=env))
    assert rank == {"restored_params": True, "restored_buffers": True, "averaged_params": True, "buffers": 2}


# ---------------------------------------------------------------------------
# benchmark commands (not run: see SNIPPETS)
# ---------------------------------------------------------------------------


@pytest.mark.deadline(90)
async def test_benchmark_blocks_name_real_flags():
    """Every --flag the benchmark commands show is one their script's --help lists."""
    blocks = [doc_snippet("docs/wire.md", "benchmarks/codec.py"),
              doc_snippet("docs/performance.md", "benchmarks/allreduce.py --quick"),
              doc_snippet("docs/performance.md", "benchmarks/rejoin.py"),
              doc_snippet("docs/performance.md", "benchmarks/controller_restart.py"),
              doc_snippet("docs/performance.md", "scale.py --hosts 2,4 --ranks-per-host 2"),
              doc_snippet("docs/performance.md", "scale.py --hosts 4 --shards"),
              doc_snippet("docs/performance.md", "--deterministic --quick")]
    flags_by_script: dict[str, set[str]] = {}
    for block in blocks:
        for line in block.strip().splitlines():
            words = shlex.split(line)
            assert words[0] == ".venv/bin/python", line
            # flags in the trailing comments count too ("--mib N, --reps N to change ...")
            flags_by_script.setdefault(words[1], set()).update(re.findall(r"(?<![\w-])--[a-z][\w-]*", line))
    assert flags_by_script.keys() == {
        "benchmarks/codec.py", "benchmarks/allreduce.py", "benchmarks/rejoin.py", "benchmarks/controller_restart.py",
        "benchmarks/scale.py",
    }
    async with open_processes() as processes:
        for script, flags in flags_by_script.items():
            usage = await processes.run(f"{script} --help", [sys.executable, script, "--help"], env=snippet_env(),
                                        cwd=ROOT, seconds=60)
            missing = sorted(flag for flag in flags if not re.search(rf"{re.escape(flag)}\b", usage))
            assert not missing, f"{script} --help does not list {missing}:\n{usage}"
