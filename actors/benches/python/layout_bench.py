"""CPU time of one forward and backward of the benchmark models (ddp_train.py's small CNN
and ResNet-18), batch 64, one libtorch thread: NCHW against channels-last, and with only
the input channels-last (what `imgrun train` hands libtorch on the CPU: the loader's NHWC
batch as it is). Timed with time.process_time, so other load on the machine moves it
little.

    /root/.cache/imgrun/torch-2.11.0/bin/python actors/benches/python/layout_bench.py
"""

import os
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ddp_train import ResNet18, SmallCnn  # noqa: E402


def cpu_ms_per_step(model, size, steps, model_format, input_format):
    model = model.to(memory_format=model_format)
    x = torch.randn(64, 3, size, size).contiguous(memory_format=input_format)
    y = torch.randint(0, 10, (64,))
    loss = nn.CrossEntropyLoss()
    for _ in range(2):
        loss(model(x), y).backward()
    start = time.process_time()
    for _ in range(steps):
        model.zero_grad()
        loss(model(x), y).backward()
    return (time.process_time() - start) / steps * 1000


def main():
    torch.set_num_threads(1)
    nchw, last = torch.contiguous_format, torch.channels_last
    for name, make, size, steps in (("small_cnn width 16, 48 px", lambda: SmallCnn(16, 10), 48, 30),
                                    ("resnet18, 64 px", lambda: ResNet18(10), 64, 5)):
        a = cpu_ms_per_step(make(), size, steps, nchw, nchw)
        b = cpu_ms_per_step(make(), size, steps, nchw, last)
        c = cpu_ms_per_step(make(), size, steps, last, last)
        print(f"{name}: NCHW {a:.1f} ms, input channels-last {b:.1f} ms ({a / b:.2f}x), "
              f"model and input channels-last {c:.1f} ms ({a / c:.2f}x) CPU per step")


if __name__ == "__main__":
    main()
