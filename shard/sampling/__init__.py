"""Choosing each row's next token: per-request sampling parameters, penalties, and structured output's token masks."""
