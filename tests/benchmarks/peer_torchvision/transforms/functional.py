"""torchvision.transforms.functional on PIL images: crop, and what diffusers' Kontext script calls (resize,
center_crop, hflip, to_tensor, normalize)."""


def crop(image, top, left, height, width):
    return image.crop((left, top, left + width, top + height))


def resize(image, size, interpolation=None):
    """A pair (height, width) resizes to it; an int resizes the shorter side to it."""
    from . import InterpolationMode, Resize

    return Resize(size, interpolation or InterpolationMode.BILINEAR)(image)


def center_crop(image, size):
    from . import CenterCrop

    return CenterCrop(size)(image)


def hflip(image):
    from PIL import Image

    return image.transpose(Image.FLIP_LEFT_RIGHT)


def to_tensor(image):
    from . import ToTensor

    return ToTensor()(image)


def normalize(tensor, mean, std):
    from . import Normalize

    return Normalize(mean, std)(tensor)
