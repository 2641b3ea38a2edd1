"""Every command that README.md and docs/ show in a fenced `bash` block is one fsdpkit accepts as
written: its command line parses, and a run's config composes and passes the world-size checks for
the world size the command names, before anything is launched.

What counts as a command: `fsdpkit ...`, `torchrun ... -m fsdpkit ...` and `make ...`, after bash's
own rewriting of the block, done here in Python: backslash continuations joined, `# comments`
dropped, variables assigned in the block (`ARGS="..."`) expanded (unquoted: split into words),
`for ...; do ...; done` bodies, `;`, `&`, `&&`, `|` separators, redirections and leading
`NAME=value` environment settings taken apart. Placeholders stay as written (`$HOME/models/...`,
`HOST:29500`): validation reads no file and reaches no host, as the launcher's own checks before
any rank starts do not. World sizes: `--nproc N` (1 without it), `resume-check`'s `--nproc` and
each of `--resume-nproc`, `torchrun`'s `--nnodes` x `--nproc-per-node`. `make` commands name a
target of the Makefile. The commands that run in seconds are marked runnable and run in
tests/unit/test_docs.py.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from fsdpkit.cli.main import _parse
from fsdpkit.cli.resume_check import check_before_running
from fsdpkit.config import check_world_size, compose_config

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BASH_BLOCK = re.compile(r"^```(?:bash|sh|shell|console)[^\n]*\n(.*?)^```", re.M | re.S)
SEPARATORS = {";", "&", "&&", "||", "|", "(", ")"}
REDIRECTS = {">", ">>", "<", ">&", "&>", "<&", ">|"}
SHELL_WORDS = {"for", "while", "until", "if", "done", "fi", "esac", "case"}
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
VARIABLE = re.compile(r"\$(?:\{(\w+)\}|(\w+))")


@dataclass(frozen=True)
class Command:
    where: str  # page:line of the command's first line
    argv: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.where}: {' '.join(self.argv)}"


def _logical_lines(block: str, first_line: int) -> list[tuple[int, str]]:
    """(line number, text) per logical line: continuations joined, as bash reads them."""
    out, pending, start = [], "", first_line
    for number, line in enumerate(block.splitlines(), first_line):
        if not pending:
            start = number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        out.append((start, pending + line))
        pending = ""
    if pending:
        out.append((start, pending))
    return out


def _expand(token: str, variables: dict[str, str]) -> list[str]:
    """A word with the block's own variables expanded: a word that is one variable splits into words
    (the docs write them unquoted); others (`$HOME`, a loop variable) stay as written."""
    whole = VARIABLE.fullmatch(token)
    if whole and (whole.group(1) or whole.group(2)) in variables:
        return variables[whole.group(1) or whole.group(2)].split()
    return [VARIABLE.sub(lambda m: variables.get(m.group(1) or m.group(2), m.group(0)), token)]


def _without_comment(line: str) -> str:
    """The line up to its comment: a `#` that starts a word outside quotes."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def _simple_commands(line: str) -> list[list[str]]:
    lexer = shlex.shlex(_without_comment(line), posix=True, punctuation_chars=True)
    lexer.whitespace_split, lexer.commenters = True, ""
    words = list(lexer)
    commands, current, skip = [], [], False
    for i, word in enumerate(words):
        if skip:
            skip = False
        elif word in SEPARATORS:
            commands.append(current)
            current = []
        elif word in REDIRECTS:
            if current and current[-1].isdigit() and i + 1 < len(words):  # 2>&1: the 2 is a file descriptor
                current.pop()
            skip = True  # the redirection's target
        else:
            current.append(word)
    commands.append(current)
    out = []
    for words in commands:
        while words and words[0] in ("do", "then", "else", "{", "}", "time", "!"):
            words = words[1:]
        if words and words[0] not in SHELL_WORDS:
            out.append(words)
    return out


def documented_commands(page: Path, *, root: Path = ROOT) -> list[Command]:
    """Every command of the page's bash blocks, in order, with the block's variables expanded."""
    text = page.read_text()
    out = []
    for match in BASH_BLOCK.finditer(text):
        first = text.count("\n", 0, match.start(1)) + 1
        variables: dict[str, str] = {}
        for number, line in _logical_lines(match.group(1), first):
            for words in _simple_commands(line):
                if all(ASSIGNMENT.match(w) for w in words):  # ARGS="..." on its own: a shell variable
                    variables.update(w.split("=", 1) for w in words)
                    continue
                while words and ASSIGNMENT.match(words[0]):  # VAR=1 cmd: the command's environment
                    words = words[1:]
                argv = [part for word in words for part in _expand(word, variables)]
                if argv and argv[0] in ("fsdpkit", "torchrun", "make"):
                    out.append(Command(f"{page.relative_to(root)}:{number}", tuple(argv)))
    return out


def _all_commands() -> list[Command]:
    return [c for page in PAGES for c in documented_commands(page)]


def _make_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z][\w.-]*):", (ROOT / "Makefile").read_text(), re.M))


def _torchrun_to_fsdpkit(argv: tuple[str, ...]) -> tuple[list[str], int, int] | None:
    """(fsdpkit's argv, world size, ranks per node) of `torchrun ... -m fsdpkit ...`; None for a
    script of this repository (examples/*.py), once it is found and declares every flag given.

    Raises:
        ValueError: no such script, or a flag it does not declare."""
    from torch.distributed.run import get_args_parser

    args = get_args_parser().parse_args(list(argv[1:]))
    if not args.module:
        script = ROOT / args.training_script
        if not script.is_file():
            raise ValueError(f"{args.training_script} is no file of this repository")
        unknown = [f for f in args.training_script_args if f.startswith("--") and f'"{f}"' not in script.read_text()]
        if unknown:
            raise ValueError(f"{args.training_script} declares no {unknown}")
        return None
    if args.training_script != "fsdpkit":
        raise ValueError(f"torchrun -m {args.training_script}: only -m fsdpkit is checked here")
    nodes = int(str(args.nnodes).split(":")[-1])  # "2" or "1:4" (elastic: the most)
    per_node = int(args.nproc_per_node)
    return ["fsdpkit", *args.training_script_args], nodes * per_node, per_node


def validate(command: Command) -> str:
    """What the command does, checked as fsdpkit checks it before launching anything; raises on a
    command fsdpkit would refuse. Returns a one-line description (for the failure message)."""
    argv, world, per_node = list(command.argv), None, None
    if argv[0] == "make":
        missing = [t for t in argv[1:] if "=" not in t and not t.startswith("-") and t not in _make_targets()]
        if missing:
            raise ValueError(f"the Makefile has no target {missing}")
        return "make"
    if argv[0] == "torchrun":
        launched = _torchrun_to_fsdpkit(command.argv)
        if launched is None:
            return "torchrun of a script"
        argv, world, per_node = launched
    try:
        args = _parse(argv[1:])  # the parser `fsdpkit` runs: an unknown flag exits 2
    except SystemExit as e:
        if e.code == 0:  # --help
            return "fsdpkit --help"
        raise ValueError(f"`fsdpkit` refuses the command line (exit {e.code})") from None
    dirs = [str(ROOT / d) for d in getattr(args, "config_dir", [])]
    if args.command == "train":
        world = world or args.nproc or 1
        check_world_size(compose_config(args.overrides, config_dirs=dirs), world,
                         local_world_size=per_node or args.nproc or 1)
        return f"train on {world} rank(s)"
    if args.command == "resume-check":
        sizes = args.resume_nproc or [args.nproc]
        check_before_running(overrides=args.overrides, nproc=args.nproc, resume_nproc=sizes, steps=args.steps,
                             save_at=args.save_at, config_dirs=dirs,
                             resume_overrides=[o for group in args.resume_overrides for o in shlex.split(group)])
        return f"resume-check on {args.nproc} then {sizes} rank(s)"
    if args.command == "config" and args.action == "show":
        compose_config(args.overrides, config_dirs=dirs)
    return f"fsdpkit {args.command}"


def test_every_documented_command_is_accepted_as_written():
    refused = []
    for command in _all_commands():
        try:
            validate(command)
        except (ValueError, FileNotFoundError) as e:
            refused.append(f"{command}\n    -> {e}")
    assert not refused, f"{len(refused)} documented command(s) would be refused:\n" + "\n".join(refused)


def test_the_commands_that_matter_are_found():
    """The extraction sees what a newcomer copies: if it found nothing, the test above would pass."""
    found = {str(c).split(": ", 1)[1] for c in _all_commands()}
    readme = {" ".join(c.argv) for c in documented_commands(ROOT / "README.md")}
    assert any(c.startswith("fsdpkit train --nproc 8 model=hf model.path=") and "model.peft.method=lora" in c
               for c in readme), readme
    assert "fsdpkit resume-check experiment=demo --resume-nproc 2,3" in readme
    assert any(c.startswith("torchrun --nnodes 2 --nproc-per-node 8") for c in found)
    assert "make demo" in readme
    kinds = {c.argv[1] for c in _all_commands() if c.argv[0] == "fsdpkit"}
    assert {"train", "resume-check", "ckpt", "config", "plot"} <= kinds, kinds
    assert len(found) >= 40, len(found)


@pytest.mark.parametrize(("block", "expected"), [
    ('ARGS="a=1 \\\n  b=2"\nfor n in 0 1; do  # two\n'
     "  torchrun --nnodes 2 --nproc-per-node 2 -m fsdpkit train $ARGS \\\n"
     "      c=3 > runs/n$n.log 2>&1 &\ndone; wait\nfsdpkit train --nproc 4 $ARGS  # four ranks\n",
     [("torchrun", "--nnodes", "2", "--nproc-per-node", "2", "-m", "fsdpkit", "train", "a=1", "b=2", "c=3"),
      ("fsdpkit", "train", "--nproc", "4", "a=1", "b=2")]),
    ("X=1 torchrun -m fsdpkit train model.path=$HOME/m  # x\nmake demo && make test\n",
     [("torchrun", "-m", "fsdpkit", "train", "model.path=$HOME/m"), ("make", "demo"), ("make", "test")]),
])
def test_commands_are_read_as_bash_reads_them(tmp_path, block, expected):
    page = tmp_path / "page.md"
    page.write_text(f"text\n```bash\n{block}```\n")
    assert [c.argv for c in documented_commands(page, root=tmp_path)] == expected
