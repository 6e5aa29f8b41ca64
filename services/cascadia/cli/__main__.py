"""`python -m cascadia.cli`: the command line, as the `cascadia` entry point runs it."""

from cascadia.cli import main

main()
