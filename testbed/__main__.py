"""`python -m testbed`: the testbed's command line (`testbed.cli`)."""

from dflash_offline.progress import run_cli
from testbed.cli import main

run_cli(main)
