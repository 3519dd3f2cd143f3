"""Reads a folder of TensorBoard event files with TensorBoard's own reader and prints its
scalars as JSON: {tag: [[step, value], ...]} (what TensorBoard would chart)."""

import json
import sys

from tensorboard.backend.event_processing import event_accumulator


def main():
    accumulator = event_accumulator.EventAccumulator(
        sys.argv[1], size_guidance={event_accumulator.SCALARS: 0}
    )
    accumulator.Reload()
    scalars = {
        tag: [[event.step, event.value] for event in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
    }
    print(json.dumps(scalars))


if __name__ == "__main__":
    main()
