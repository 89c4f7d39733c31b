"""The command-line parser of every `python -m gcompile.…` command: a bad flag is one line, exit status 2.

argparse prints its whole usage block before the error, several lines that bury the one that
matters; this prints only that one and says where the flags are listed. Flags are never
abbreviated (Megatron's parser does the same): a command that passes run_gpt.py's flags on
would otherwise take one as a prefix of its own (the planner read `--micro-batch-size 4` as
`--micro-batch-sizes 4`), and `--auto-layout` strips layout flags by their whole names. run_gpt.py's
parser (gcompile.config) is one of these whose errors go to its own one-line report."""

import argparse
import sys


class ArgumentParser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{"allow_abbrev": False, **kwargs})

    def error(self, message: str):
        print(f"{self.prog}: error: {message} ({self.prog} --help lists the flags)", file=sys.stderr)
        sys.exit(2)
