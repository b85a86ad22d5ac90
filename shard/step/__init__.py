"""One step of the engine: a flat forward over every running request's new tokens, its sampling and stopping, and
the `Generation` records the router streams."""
