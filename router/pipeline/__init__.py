"""From an API's typed request to a `ValidRequest`: the one internal request, its mapping from each API, and the one
validation every front door calls (bounds, tokens, defaults, constraints)."""
