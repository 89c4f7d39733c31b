"""The command-line parser of every `python -m gcompile.…` command: a bad flag is one line, exit status 2.

argparse prints its whole usage block before the error, several lines that bury the one that
matters; this prints only that one and says where the flags are listed."""

import argparse
import sys


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str):
        print(f"{self.prog}: error: {message} ({self.prog} --help lists the flags)", file=sys.stderr)
        sys.exit(2)
