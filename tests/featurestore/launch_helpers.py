"""Scripts the launch tests run: a rank that says it started and waits, and `train launch` but for what
torchrun runs (``test_stream_launch_qa8.py``, ``test_stream_launch_qa9.py``)."""

#: A rank: an eaglenest command that says it started and waits to be stopped.
RANK = """
import sys, time
from eaglenest.cli import Command, run

def body(recipe, args):
    sys.stdout.write("started\\n")  # one write: the ranks share the pipe (print writes its end apart)
    sys.stdout.flush()
    time.sleep(120)

sys.exit(run("train", "a rank", {"go": Command(body, "go", needs_recipe=False)}, ["go"]))
"""

#: `train launch` but for what torchrun runs: the launcher's own wait_torchrun and torchrun wrapper.
LAUNCHER = """
import sys
from eaglenest.cli import Command, run
from eaglenest.pipeline.train_cli import _TORCHRUN, wait_torchrun

def body(recipe, args):
    return wait_torchrun([sys.executable, "-c", _TORCHRUN, "--standalone", "--nproc-per-node=2",
                          "--max-restarts=0", sys.argv[1]])

sys.exit(run("train", "a launcher", {"launch": Command(body, "launch", needs_recipe=False)}, ["launch"]))
"""
