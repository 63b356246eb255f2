"""`python -m testbed`: the testbed's command line (`testbed.cli`)."""

from dflash_offline.cli import run_cli
from testbed.cli import main

run_cli(main, stop_on_sigterm=False)  # (SIGTERM ends it at once: a rerun resumes; no drafter in flight waited for)
