"""The `cascadia` command line: `app` (cli/app.py) with its commands registered by the modules below, each a
group of commands that parse their options and delegate: serve (the roles), model_tools, fleet_tools, bench."""

from __future__ import annotations

from cascadia.cli import bench, fleet_tools, model_tools, serve  # noqa: F401 (each registers its commands)
from cascadia.cli.app import app

__all__ = ["app", "main"]


def main() -> None:
    from cascadia.parent import follow_parent

    follow_parent()
    app()
