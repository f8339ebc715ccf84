"""torchvision.transforms as diffusers' example scripts call them (see the package's docstring)."""
import enum
import random

import numpy as np
import torch
from PIL import Image

from .functional import crop


class InterpolationMode(enum.Enum):
    NEAREST = Image.NEAREST
    BILINEAR = Image.BILINEAR
    BICUBIC = Image.BICUBIC
    LANCZOS = Image.LANCZOS


def _pair(size):
    return (size, size) if isinstance(size, int) else tuple(size)


class Compose:
    def __init__(self, transforms):
        self.transforms = transforms

    def __call__(self, x):
        for transform in self.transforms:
            x = transform(x)
        return x


class Resize:
    """An int resizes the shorter side to it (the aspect kept); a pair (height, width) resizes to it."""

    def __init__(self, size, interpolation=InterpolationMode.BILINEAR):
        self.size, self.interpolation = size, interpolation

    def __call__(self, image):
        w, h = image.size
        if isinstance(self.size, int):
            scale = self.size / min(w, h)
            target = (max(self.size, round(w * scale)), max(self.size, round(h * scale)))
        else:
            target = (self.size[1], self.size[0])
        return image if target == (w, h) else image.resize(target, self.interpolation.value)


class CenterCrop:
    def __init__(self, size):
        self.size = _pair(size)

    def __call__(self, image):
        h, w = self.size
        top, left = int(round((image.height - h) / 2.0)), int(round((image.width - w) / 2.0))
        return crop(image, top, left, h, w)


class RandomCrop:
    def __init__(self, size):
        self.size = _pair(size)

    @staticmethod
    def get_params(image, output_size):
        h, w = output_size
        return random.randint(0, image.height - h), random.randint(0, image.width - w), h, w

    def __call__(self, image):
        return crop(image, *self.get_params(image, self.size))


class RandomHorizontalFlip:
    def __init__(self, p=0.5):
        self.p = p

    def __call__(self, image):
        return image.transpose(Image.FLIP_LEFT_RIGHT) if random.random() < self.p else image


class ToTensor:
    """PIL -> float [C, H, W] in [0, 1]."""

    def __call__(self, image):
        array = np.asarray(image, dtype=np.float32) / 255.0
        array = array[:, :, None] if array.ndim == 2 else array
        return torch.from_numpy(array.copy()).permute(2, 0, 1)


class Normalize:
    def __init__(self, mean, std):
        self.mean, self.std = mean, std

    def __call__(self, tensor):
        mean = torch.tensor(self.mean, dtype=tensor.dtype).view(-1, 1, 1)
        std = torch.tensor(self.std, dtype=tensor.dtype).view(-1, 1, 1)
        return (tensor - mean) / std


class Lambda:
    def __init__(self, fn):
        self.fn = fn

    def __call__(self, x):
        return self.fn(x)
