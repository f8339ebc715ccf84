"""torchvision.transforms.functional.crop on a PIL image."""


def crop(image, top, left, height, width):
    return image.crop((left, top, left + width, top + height))
