"""The `jupyter` harness of the data agent: a notebook-like Python tool whose variables persist between calls.

Each call is a cell. The sandbox only needs `python3`: the state is rebuilt by replaying the earlier cells that ran
without error (their output hidden) before the new cell runs, like re-running a notebook from the top. That keeps the
harness free of a kernel process that would have to survive between tool calls; the price is that a cell's side
effects (files written, time spent) are repeated by every later call, which data exploration cells seldom mind.
"""

import base64

from trl.experimental.harbor import HarborEnv


NOTEBOOK_DIR = "/workdir/.notebook"
# Replays the saved cells silently, then runs the new one and shows the value of a final expression, as Jupyter does.
RUNNER = """\
import ast, contextlib, io, pathlib, sys, traceback

cells = sorted(pathlib.Path(sys.argv[1]).glob("cell_*.py"))
namespace = {"__name__": "__main__"}
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    for cell in cells:
        exec(compile(cell.read_text(), str(cell), "exec"), namespace)
source = pathlib.Path(sys.argv[2]).read_text()
try:
    tree = ast.parse(source)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, "<cell>", "exec"), namespace)
    if last is not None:
        value = eval(compile(ast.Expression(last.value), "<cell>", "eval"), namespace)
        if value is not None:
            print(repr(value))
except Exception:
    traceback.print_exc()
    sys.exit(1)
"""


def _write_file_command(path: str, text: str) -> str:
    """A shell command writing `text` to `path` (base64 keeps quotes and newlines away from the shell)."""
    return f"echo {base64.b64encode(text.encode()).decode()} | base64 -d > {path}"


class JupyterHarness(HarborEnv):
    """One tool, `python`, running notebook cells; the answer goes to `/workdir/answer.txt`."""

    PROMPT_SUFFIX = (
        "\n\nThe task's input files are in /home/user/input. Use the python tool like a Jupyter notebook: variables "
        "persist between calls and the value of a final expression is shown. When you are done, write your final "
        "answer to /workdir/answer.txt."
    )

    def _setup(self) -> None:
        self._exec(f"mkdir -p {NOTEBOOK_DIR} && " + _write_file_command(f"{NOTEBOOK_DIR}/runner.py", RUNNER))

    def python(self, code: str) -> str:
        """Run a cell of Python code in the task's notebook.

        Args:
            code: The cell's source; variables defined by earlier successful cells are available.

        Returns:
            What the cell printed, the value of its last expression, or the error's traceback.
        """
        pending = f"{NOTEBOOK_DIR}/pending.py"
        # Only a cell that ran is kept for the replays (a failing one would break every later call); the sandbox
        # numbers the kept cells, so a cut-off tool output cannot desynchronise the count.
        keep = f'mv {pending} "$(printf {NOTEBOOK_DIR}/cell_%04d.py "$(ls {NOTEBOOK_DIR} | grep -c ^cell_)")"'
        run = f"cd /workdir && python3 {NOTEBOOK_DIR}/runner.py {NOTEBOOK_DIR} {pending} && {keep}"
        return self._exec(f"{_write_file_command(pending, code)} && {run}")
