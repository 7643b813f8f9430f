"""The `terminal_notes` harness of the data agent: a shell plus a notebook of findings kept in the sandbox.

Long data tasks take many tool calls; the notes let the model keep what it learnt (column names, row counts,
intermediate results) in a few lines it can read back, instead of scrolling through earlier tool outputs.
"""

import base64

from trl.experimental.harbor import HarborBashEnv


NOTES_PATH = "/workdir/notes.md"


class TerminalNotesHarness(HarborBashEnv):
    """Tools `bash`, `write_note` and `read_notes`; the answer goes to `/workdir/answer.txt`."""

    PROMPT_SUFFIX = (
        "\n\nThe task's input files are in /home/user/input; work in /workdir. Keep what you find with write_note "
        "and read it back with read_notes." + HarborBashEnv.PROMPT_SUFFIX
    )

    def write_note(self, note: str) -> str:
        """Append a note to your notebook (kept for the whole task).

        Args:
            note: What to remember, e.g. a column name or an intermediate result.

        Returns:
            A confirmation.
        """
        # base64 keeps quotes, `$` and newlines of the note away from the shell.
        encoded = base64.b64encode(f"- {note.strip()}\n".encode()).decode()
        self._exec(f"echo {encoded} | base64 -d >> {NOTES_PATH}")
        return "Noted."

    def read_notes(self) -> str:
        """Read your notebook.

        Returns:
            Every note written so far, one per line.
        """
        notes = self._exec(f"cat {NOTES_PATH} 2>/dev/null")
        return "(no notes yet)" if notes.startswith("(no output") else notes
