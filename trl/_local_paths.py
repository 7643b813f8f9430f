"""Telling a local path from a hub id, and refusing a local path that does not exist, before anything is loaded.

Standard library only: the `trl` command checks `--model_name_or_path` and `--dataset_name` with it before it starts
`accelerate launch` (seconds before torch would be imported).
"""

import os


def looks_like_local_path(name: str) -> bool:
    """Whether `name` can only be a filesystem path: a hub id is `name` or `namespace/name`, never absolute, never
    starting with `.` or `~`, and with at most one `/`."""
    return (
        os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1 or (os.sep != "/" and os.sep in name)
    )


def missing_local_path_message(name: object, what: str) -> str | None:
    """The error message for `name` when it is a local path that does not exist, else None.

    Args:
        name: Hub id or local path (anything that is not a string passes).
        what: What is being loaded, for the message ("model", "dataset", ...).
    """
    if isinstance(name, str) and looks_like_local_path(name) and not os.path.exists(os.path.expanduser(name)):
        return (
            f"The {what} path {name!r} does not exist (it is a local path, not a hub id). Check the path for "
            "typos, or give a hub id of the form 'name' or 'namespace/name'."
        )
    return None


def check_local_path(name: object, what: str = "model") -> None:
    """Raise `FileNotFoundError` when `name` is a filesystem path that does not exist.

    Without this check, transformers and datasets take a missing local directory for a hub id and report a repo-id
    format error (or try the network) that hides the real problem: a typo in the path, or a directory never written.

    Args:
        name: Hub id or local path.
        what: What is being loaded, for the message ("model", "reward model", "dataset", ...).
    """
    message = missing_local_path_message(name, what)
    if message is not None:
        raise FileNotFoundError(message)
