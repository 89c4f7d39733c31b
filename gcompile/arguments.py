"""The command-line parser of every `python -m gcompile.…` command: a bad flag is one line, exit status 2.

argparse prints its whole usage block before the error, several lines that bury the one that
matters; this prints only that one and says where the flags are listed. Flags are never
abbreviated (Megatron's parser does the same): a command that passes run_gpt.py's flags on
would otherwise take one as a prefix of its own (the planner read `--micro-batch-size 4` as
`--micro-batch-sizes 4`), and `--auto-layout` strips layout flags by their whole names; so an unknown
flag is named with the nearest one there is (`--micro-batch 2` with --micro-batch-size). run_gpt.py's
parser (gcompile.config) is one of these whose errors go to its own one-line report."""

import argparse
import difflib
import re
import sys

UNRECOGNIZED = "unrecognized arguments: "
VALUE_TO_SWITCH = re.compile(r"argument (--[\w-]+): ignored explicit argument '.*'")
"""argparse's message for `--check-plan=false`, a value given to a flag that takes none."""
NEAR = 0.75
"""How alike (difflib's ratio) a flag must be to be offered: --micro-batch is 0.84 of --micro-batch-size,
--top-k only 0.73 of --tp (the planner's --top-k is none of run_gpt.py's flags, which it reads after its own)."""


def flag_names(parser: argparse.ArgumentParser) -> list[str]:
    return [name for action in parser._actions for name in action.option_strings if name.startswith("--")]


class ArgumentParser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{"allow_abbrev": False, **kwargs})
        self.passed_on: list[str] = []
        """Flags of the parser this one passes what it does not know on to (the planner's: run_gpt.py's), offered
        with its own for a flag neither knows."""

    def error(self, message: str):
        print(f"{self.prog}: error: {self.explain(message)} ({self.prog} --help lists the flags)", file=sys.stderr)
        sys.exit(2)

    def explain(self, message: str) -> str:
        """argparse's message, with the flag each unrecognized one may have meant, or how a switch is given."""
        if switch := VALUE_TO_SWITCH.fullmatch(message):
            return f"{message}: {switch[1]} takes no value; give {switch[1]} alone to turn it on, leave it out for off"
        if not message.startswith(UNRECOGNIZED):
            return message
        flags = flag_names(self) + self.passed_on
        meant = []
        for word in message.removeprefix(UNRECOGNIZED).split():
            flag = word.split("=")[0]
            near = difflib.get_close_matches(flag, flags, n=1, cutoff=NEAR) if flag.startswith("--") else []
            meant += [f"{near[0]} for {flag}" for _ in near[:1]]
        return message + (f"; did you mean {', '.join(meant)}?" if meant else "")

    def refuse_unknown(self, passed: list[str]) -> None:
        """Exit with one line where a flag of `passed` (what parse_known_args left) is not one of `passed_on`."""
        unknown = [word for word in passed if word.startswith("--") and word.split("=")[0] not in self.passed_on]
        if unknown:
            self.error(UNRECOGNIZED + " ".join(unknown))
