"""Images in a prompt (vision-language models): decoding and its bounds (decode.py), each image-token scheme's
preprocessing and prompt layout (qwen2_vl.py, idefics3.py), and the exported vision parts that turn pixels into the
feature rows the engine splices into the prompt (encoder.py: VisionEncoder). ImageRejected (errors.py) is apart, so
the server's admission names it without importing Pillow: a text-only model's engine process never loads the image
stack (the engine imports encoder.py for a VLM only). docs/vision.md describes the whole path."""
