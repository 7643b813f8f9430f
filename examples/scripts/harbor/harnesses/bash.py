"""The `bash` harness of the data agent: one shell tool in the task's sandbox."""

from trl.experimental.harbor import HarborBashEnv


DATA_HINT = "\n\nThe task's input files are in /home/user/input; work in /workdir."


class BashHarness(HarborBashEnv):
    """Harbor's bash environment, told where a data task's files are; the answer goes to `/workdir/answer.txt`."""

    PROMPT_SUFFIX = DATA_HINT + HarborBashEnv.PROMPT_SUFFIX
