"""Images: `decode` turns untrusted bytes into a checked RGB image (limits, EXIF, bomb guard,
content hash); `processors` are the ports of HF image processors (RGB image -> model pixels)."""
from mmjax.image.decode import ImageLimits, ImageSource, decode_data_uri, load_image, pixel_hash  # noqa: F401
