"""What the container image runs first (its ENTRYPOINT), so that it answers both ways it is started.

A command, as compose and `docker run IMAGE conveyor-shard ...` give one, runs as it is, with the image's
environment (offline: those deployments read models from /models; Kubernetes' `command` skips this module and
gets the same). Flags alone, as TGI's image took them (`docker run -p 8080:80 -v $volume:/data IMAGE --model-id
org/model`), start the launcher as TGI's image did: on every address, on port 80 unless PORT says another, the Hub
reachable and its downloads cached in /data (a local `--model-id` directory needs no Hub either way).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

TGI_PORT = "80"
TGI_CACHE = "/data"  # TGI's image: the volume its users mount, HUGGINGFACE_HUB_CACHE there
LAUNCHER = [sys.executable, "-m", "conveyor.launcher.main"]


def command(argv: list[str], env: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """The program to exec and its environment."""
    env = dict(env)
    if argv and not argv[0].startswith("-"):
        return argv, env
    env["HF_HUB_OFFLINE"] = "0"  # the image's default is offline; TGI's users download by the model's Hub id
    env.setdefault("PORT", TGI_PORT)  # read by the launcher as TGI's variable (launcher/tgi_flags.py)
    env.setdefault("HF_HUB_CACHE", TGI_CACHE)
    return [*LAUNCHER, "--hostname", "0.0.0.0", *argv], env  # the user's flags come after, and win


def main() -> None:
    program, env = command(sys.argv[1:], os.environ)
    os.execvpe(program[0], program, env)


if __name__ == "__main__":
    main()
