"""A request's token allowance, the one rule the router's planner and the shard's step both apply: how many tokens it
may still generate, and so how many draft tokens a step may verify for it.

The router plans with it (decode runs, drafts per step) and each shard holds its rows to it again, since a step's
drafts are proposed on the shard; written once here, the two cannot drift apart.
"""

from __future__ import annotations


def tokens_left(max_new_tokens: int, generated: int) -> int:
    """Tokens a request may still generate after `generated` of its `max_new_tokens`."""
    return max_new_tokens - generated


def draft_room(max_new_tokens: int, generated: int) -> int:
    """The most draft tokens one step may verify for it: every accepted draft is a token generated, and the step
    samples one more after them."""
    return tokens_left(max_new_tokens, generated) - 1
