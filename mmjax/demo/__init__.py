"""mmjax-shapes: the tiny trained LLaVA-architecture demo VLM (issue 7).

shapes.py     synthetic scenes, questions, exact answers, client-like PNG/JPEG round trip
tokenizer.py  the byte-level BPE tokenizer and the LLaVA-1.5-style chat template
config.py     the HF LlavaConfig dicts (shipped model and a smaller notebook variant)
export.py     writes a Hugging Face LLaVA-layout checkpoint without torch/transformers
"""
