"""Internals of `trl.chat_template_utils`: the chat template families (`families`), their recognition by rendering
(`recognition`) and their response parsing schemas (`schemas`). Import from `trl.chat_template_utils` instead."""
