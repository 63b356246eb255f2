"""The GPU quality yardstick (`python -m testbed`, make testbed): a small real target trained from Python sources,
the whole pipeline run through the stage CLIs, drafter quality measured as real τ and compared by A/B. It uses the
library and the stages as a user does; nothing in the library imports it."""
