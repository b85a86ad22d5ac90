"""The image's entrypoint (launcher/image.py): a command runs as it is, with the image's environment; flags alone
start the launcher as TGI's image did. The last test execs it for real, as the image does, as far as `--help`."""

from __future__ import annotations

import subprocess
import sys

from conveyor.launcher import image

IMAGE_ENV = {"HF_HUB_OFFLINE": "1", "CONVEYOR_CACHE": "/models"}  # what the Dockerfile sets


def test_a_command_runs_as_it_is() -> None:
    argv = ["conveyor-shard", "--model-id", "/models/m", "--listen", "0.0.0.0:7000"]
    assert image.command(argv, IMAGE_ENV) == (argv, IMAGE_ENV)


def test_flags_alone_start_the_launcher_as_tgis_image_did() -> None:
    program, env = image.command(["--model-id", "org/model", "--num-shard", "2"], IMAGE_ENV)
    assert program == [*image.LAUNCHER, "--hostname", "0.0.0.0", "--model-id", "org/model", "--num-shard", "2"]
    assert (env["PORT"], env["HF_HUB_CACHE"], env["HF_HUB_OFFLINE"]) == ("80", "/data", "0")
    assert env["CONVEYOR_CACHE"] == "/models"


def test_no_arguments_read_tgis_variables_and_the_users_own_win() -> None:
    program, env = image.command([], {**IMAGE_ENV, "MODEL_ID": "org/model", "PORT": "8080", "HF_HUB_CACHE": "/c"})
    assert program == [*image.LAUNCHER, "--hostname", "0.0.0.0"]
    assert (env["MODEL_ID"], env["PORT"], env["HF_HUB_CACHE"]) == ("org/model", "8080", "/c")


def test_the_entrypoint_execs_the_launcher() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "conveyor.launcher.image", "--help"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "--model-id" in done.stdout and "--hostname" in done.stdout
