"""Vision-language models at run time: the vision stage (vision.py), the language graph's image inputs
(media.py), the processor (processor.py) and multimodal positions (positions.py)."""
