"""Implementation modules of `trl.data_utils`, split by concern; `trl.data_utils` is the public front that re-exports
their names (import from there)."""
