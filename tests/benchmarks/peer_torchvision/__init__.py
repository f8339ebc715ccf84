"""A stand-in for the few torchvision transforms diffusers' example scripts use on PIL images (Resize, CenterCrop,
RandomCrop, RandomHorizontalFlip, ToTensor, Normalize, Compose; functional's crop, and resize, center_crop, hflip,
to_tensor and normalize for the Kontext script), written here on PIL and torch: the torchvision wheel on the package
registry does not import beside this project's CPU torch. tests/benchmarks/peer_run.py registers it as torchvision for
a peer script's run only; the recipes never use it."""
from . import transforms  # noqa: F401
