"""`python -m testbed`: the testbed's command line (`testbed.cli`)."""

from dflash_offline.cli import run_cli
from testbed.cli import end_on_sigterm, main

end_on_sigterm()  # (SIGTERM ends it at once, and what it started with it: a rerun resumes)
run_cli(main, stop_on_sigterm=False)
