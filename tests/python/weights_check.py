"""Loads weights that `imgrun export` wrote into PyTorch modules, as a user would, for
tests/export.rs.

  weights_check.py images OUT               a fixed batch [4, 3, 32, 32] as safetensors
  weights_check.py torchvision MODEL N OUT  torchvision's freshly initialised MODEL with N
                                            classes, saved with torch.save(state_dict())
  weights_check.py check MODEL N WIDTH PT SAFETENSORS IMAGES LOGITS [INIT]
      loads both exports (the .pt also with mmap=True) with load_state_dict(strict=True) into MODEL (a torchvision
      ResNet, or small_cnn of WIDTH, defined below as imgrun builds it), checks that they
      hold the same tensors with PyTorch's dtypes, and that the model's eval-mode logits on
      IMAGES match imgrun's (LOGITS) within 1e-4. With INIT (a torch.save state dict), the
      exported parameters must be INIT's: the job started from it and did not move them.
Prints one line per check; exits non-zero with the reason on failure.
"""

import sys

import torch
import torch.nn.functional as F
import torchvision
from safetensors.torch import load_file, save_file

TOLERANCE = 1e-4


class Block(torch.nn.Module):
    """imgrun's conv_block: conv 3x3 (no bias), BatchNorm, ReLU."""

    def __init__(self, c_in, c_out):
        super().__init__()
        self.conv = torch.nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)
        self.bn = torch.nn.BatchNorm2d(c_out)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)))


class SmallCnn(torch.nn.Module):
    """imgrun's small_cnn: four blocks, max-pooling between them, global average pool,
    linear classifier."""

    def __init__(self, classes, width):
        super().__init__()
        self.block1 = Block(3, width)
        self.block2 = Block(width, 2 * width)
        self.block3 = Block(2 * width, 4 * width)
        self.block4 = Block(4 * width, 8 * width)
        self.fc = torch.nn.Linear(8 * width, classes)

    def forward(self, x):
        x = F.max_pool2d(self.block1(x), 2)
        x = F.max_pool2d(self.block2(x), 2)
        x = F.max_pool2d(self.block3(x), 2)
        x = F.adaptive_avg_pool2d(self.block4(x), 1).flatten(1)
        return self.fc(x)


def build(model, classes, width):
    if model == "small_cnn":
        return SmallCnn(classes, width)
    return getattr(torchvision.models, model)(num_classes=classes)


def fail(message):
    print(f"FAIL: {message}", file=sys.stderr)
    sys.exit(1)


def check(model, classes, width, pt, safetensors, images, logits, init=None):
    from_pt = torch.load(pt, weights_only=True)
    from_st = load_file(safetensors)
    if list(sorted(from_pt)) != list(sorted(from_st)):
        fail(f"the files name different tensors: {sorted(set(from_pt) ^ set(from_st))}")
    for name, tensor in from_pt.items():
        other = from_st[name]
        if tensor.dtype != other.dtype or not torch.equal(tensor, other):
            fail(f"{name} differs between {pt} and {safetensors}")
        want = torch.int64 if name.endswith("num_batches_tracked") else torch.float32
        if tensor.dtype != want:
            fail(f"{name} is {tensor.dtype}, PyTorch keeps {want}")
    # Records aligned as torch.save aligns them: the file maps as well as it reads.
    mapped = torch.load(pt, weights_only=True, mmap=True)
    if any(not torch.equal(mapped[name], tensor) for name, tensor in from_pt.items()):
        fail(f"{pt} reads differently with mmap=True")
    print(f"same {len(from_pt)} tensors in both files, with PyTorch's dtypes")
    batch = load_file(images)["images"]
    want = load_file(logits)["logits"]
    for path, state in [(pt, from_pt), (safetensors, from_st)]:
        net = build(model, classes, width)
        # strict=True: every name of the module is in the file and nothing else.
        net.load_state_dict(state, strict=True)
        net.eval()
        with torch.no_grad():
            got = net(batch)
        diff = (got - want).abs().max().item()
        if got.shape != want.shape or not diff <= TOLERANCE:
            fail(f"{path}: logits {tuple(got.shape)} differ from imgrun's by {diff}")
        print(f"{path}: strict load, logits within {diff:.2e} of imgrun's")
    if init is not None:
        start = torch.load(init, weights_only=True)
        parameters = dict(build(model, classes, width).named_parameters())
        for name in parameters:
            diff = (from_pt[name] - start[name]).abs().max().item()
            if not diff <= 1e-12:
                fail(f"{name} is {diff} away from {init}'s: not started from it")
        print(f"all {len(parameters)} parameters are {init}'s")


def main(argv):
    command = argv[1]
    torch.manual_seed(0)
    if command == "images":
        save_file({"images": torch.randn(4, 3, 32, 32)}, argv[2])
    elif command == "torchvision":
        net = getattr(torchvision.models, argv[2])(num_classes=int(argv[3]))
        torch.save(net.state_dict(), argv[4])
    elif command == "check":
        model, classes, width = argv[2], int(argv[3]), int(argv[4])
        check(model, classes, width, *argv[5:])
    else:
        fail(f"unknown command {command}")


if __name__ == "__main__":
    main(sys.argv)
