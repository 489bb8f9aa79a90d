"""Images in a prompt (vision-language models): decoding and its bounds (decode.py), each image-token scheme's
preprocessing and prompt layout (qwen2_vl.py, idefics3.py), and the exported vision parts that turn pixels into the
feature rows the engine splices into the prompt (encoder.py). docs/vision.md describes the whole path."""

from appliance.runtime.vision.decode import ImageRejected
from appliance.runtime.vision.encoder import VisionEncoder

__all__ = ["ImageRejected", "VisionEncoder"]
