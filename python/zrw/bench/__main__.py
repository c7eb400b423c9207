"""`python -m zrw.bench NAME [--json]`: run one benchmark by name.

`python -m zrw.bench report FILE.json...` turns what `NAME --json` printed into the stamped
markdown tables of docs/benchmarks.md (`--update docs/benchmarks.md` rewrites them in place).
"""

import importlib
import sys

BENCHMARKS = {
    "linear": "zrw.bench.linear",
    "quant": "zrw.bench.quant",
    "cache": "zrw.bench.cache",
    "fsdp": "zrw.bench.fsdp",
    "step": "zrw.bench.step",
    "seed": "zrw.bench.seed",
    "hf": "zrw.bench.hf",
    "accuracy": "zrw.bench.accuracy",
}
# not benchmarks: commands over their output
COMMANDS = {"report": "zrw.bench.report"}


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    every = {**BENCHMARKS, **COMMANDS}
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in every:
        known = ", ".join(sorted(BENCHMARKS))
        if argv and argv[0] not in ("-h", "--help"):
            print(f"unknown benchmark {argv[0]!r}; known: {known}", file=sys.stderr)
            sys.exit(2)
        print(
            f"usage: python -m zrw.bench NAME [--json] [options]\nbenchmarks: {known}\n"
            "python -m zrw.bench report [--update PAGE] FILE.json...: the markdown tables"
        )
        return
    importlib.import_module(every[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    main()
