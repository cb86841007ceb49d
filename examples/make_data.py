"""Write a tiny GRPO dataset in verl's row format: examples/data/train.parquet and val.parquet.

    python examples/make_data.py [--out examples/data]

Each row is one prompt (a chat message list), the name of its task (`data_source`) and the answer
the reward function compares against (`reward_model.ground_truth`). Your own data needs only these
columns; `extra_info` is passed to the reward function as it is.
"""

import argparse
import os
import random

import pyarrow as pa
import pyarrow.parquet as pq

WORDS = (
    "cat dog sun tree house river apple garden window orange planet music bridge pencil yellow "
    "forest candle silver rocket dragon island number puzzle marble summer winter"
).split()


def make_rows(words: list[str], split: str) -> list[dict]:
    return [
        {
            "data_source": "letter_count",  # the task; the reward function may branch on it
            "prompt": [
                {"role": "user", "content": f"How many letters are in the word '{word}'? Answer with a number."}
            ],
            "reward_model": {"style": "rule", "ground_truth": str(len(word))},
            "extra_info": {"split": split, "index": index, "word": word},
        }
        for index, word in enumerate(words)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "data"))
    args = parser.parse_args()
    words = list(WORDS)
    random.Random(0).shuffle(words)
    os.makedirs(args.out, exist_ok=True)
    for split, part in (("train", words[:20]), ("val", words[20:])):
        path = os.path.join(args.out, f"{split}.parquet")
        pq.write_table(pa.Table.from_pylist(make_rows(part, split)), path)
        print(f"wrote {path}: {len(part)} rows")


if __name__ == "__main__":
    main()
