"""Write a synthetic task's train and val splits as verl-schema parquet files.

    python -m rlstack.data.make_arith --out DIR --train N --val M [--seed S] [--task arith]

writes DIR/train.parquet and DIR/val.parquet (none with --val 0); use them as data.train_files / data.val_files.
"""

from __future__ import annotations

import argparse
import os

from rlstack.data.rows import write_parquet
from rlstack.data.synthetic import SYNTHETIC_TASKS, make_rows


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--train", type=int, required=True, help="number of train rows")
    parser.add_argument("--val", type=int, required=True, help="number of val rows")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--task", default="arith", choices=sorted(SYNTHETIC_TASKS))
    parser.add_argument("--max-operand", type=int, default=20, help="largest number in arith problems")
    return parser.parse_args(argv)


def main(argv=None) -> list[str]:
    args = parse_args(argv)
    if args.train < 1 or args.val < 0:
        raise SystemExit("make_arith: --train must be at least 1 and --val at least 0")
    paths = []
    for split, n in (("train", args.train), ("val", args.val)):
        if n == 0:
            continue  # an empty parquet file would not load as a dataset
        rows = make_rows(args.task, n, args.seed, split, args.max_operand)
        path = os.path.join(args.out, f"{split}.parquet")
        write_parquet(rows, path)
        print(f"wrote {len(rows)} {args.task} rows to {path}")
        paths.append(path)
    return paths


if __name__ == "__main__":
    main()
