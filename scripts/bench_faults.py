#!/usr/bin/env python3
"""Deadlines and failure detection with the real model: ``edgenode bench --only faults``
(``node.bench.faults`` says what is measured), printed as a table and JSON.

Usage: ``python scripts/bench_faults.py [--quick] [--engine llama|test]``.
"""

from __future__ import annotations

import argparse
import json

from node.bench import faults
from node.bench.context import BenchContext, NoProgress
from node.bench.report import markdown_table


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"{faults.QUICK.describe()}; without it {faults.FULL.describe()}",
    )
    parser.add_argument("--engine", choices=("llama", "test"), default="llama")
    args = parser.parse_args()
    ctx = BenchContext(args.quick, args.engine, None, NoProgress())
    section = faults.run(ctx)
    print(section.text)
    for table in section.tables:
        print(markdown_table(table))
    print(json.dumps(section.data))


if __name__ == "__main__":
    main()
