"""The `trl` command line (`trl sft`, `trl dpo`, ..., `trl env`, `trl vllm-serve`).

Importing this package stays cheap: torch, transformers and accelerate load only when a command runs.
"""

from .main import main


__all__ = ["main"]
