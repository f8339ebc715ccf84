"""torchvision.transforms.functional as diffusers' example scripts call it, on a PIL image (or, for normalize, a
tensor): crop, resize, center_crop, hflip, to_tensor, normalize."""


def crop(image, top, left, height, width):
    return image.crop((left, top, left + width, top + height))


def resize(image, size, interpolation=None):
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
