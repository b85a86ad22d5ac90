"""Conveyor: an LLM text-generation server built around continuous batching.

The subpackages live in the repository's top-level folders (see pyproject.toml):
`conveyor.router` (router/), `conveyor.shard` (shard/), `conveyor.launcher` (launcher/),
`conveyor.client` (client/) and the generated wire contract `conveyor.v1` (proto/conveyor/v1/).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("conveyor")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0"
